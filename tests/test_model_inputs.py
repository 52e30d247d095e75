"""Example batches built from the config: encoder-decoder lengths, speech features,
image sizes and image tokens."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_GEMMA3, TINY_VISION

from vramplan.errors import UserError
from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe
from vramplan.sources import resolve

WHISPER = {
    "model_type": "whisper",
    "architectures": ["WhisperForConditionalGeneration"],
    "vocab_size": 96,
    "d_model": 32,
    "num_hidden_layers": 1,
    "encoder_layers": 1,
    "decoder_layers": 1,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "num_mel_bins": 128,
    "max_source_positions": 1500,
    "max_target_positions": 448,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 3,
}
T5 = {
    "model_type": "t5",
    "architectures": ["T5ForConditionalGeneration"],
    "vocab_size": 96,
    "d_model": 32,
    "d_kv": 8,
    "d_ff": 64,
    "num_layers": 1,
    "num_heads": 4,
    "decoder_start_token_id": 0,
    "pad_token_id": 0,
}
VISION = TINY_VISION
CLIP = {
    "model_type": "clip",
    "architectures": ["CLIPModel"],
    "projection_dim": 16,
    "text_config": {
        "model_type": "clip_text_model",
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "max_position_embeddings": 77,
    },
    "vision_config": VISION,
}
LLAVA = {
    "model_type": "llava",
    "architectures": ["LlavaForConditionalGeneration"],
    "image_token_id": 95,
    "vision_feature_layer": -1,
    "vision_feature_select_strategy": "default",
    "vision_config": VISION,
    "text_config": {
        "model_type": "llama",
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
}


def _config(tmp_path, data) -> str:
    path = tmp_path / f"{data['model_type']}-{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps(data))
    return f"hf:{path}"


def test_whisper_features_and_decoder_length_from_the_config(tmp_path):
    model = _config(tmp_path, WHISPER)
    built = resolve(model, Recipe(batch_size=2, precision="bf16"))
    batch = built.make_batch(2, torch.float32)
    # the encoder's two convolutions (stride 1, then 2) make 2 x max_source_positions frames
    assert tuple(batch["input_features"].shape) == (2, 128, 2 * 1500)
    assert tuple(batch["labels"].shape) == (2, 448)  # max_target_positions by default
    short = resolve(model, Recipe(batch_size=2, target_len=40)).make_batch(2, torch.float32)
    assert tuple(short["labels"].shape) == (2, 40)
    small = _config(tmp_path, {**WHISPER, "max_source_positions": 50})  # traced cheaply
    peaks = [
        estimate_built(resolve(small, r), r, "cuda").peak.allocated_bytes
        for r in (Recipe(precision="bf16", target_len=40), Recipe(precision="bf16"))
    ]
    assert peaks[0] < peaks[1]
    with pytest.raises(UserError, match="learned positions"):
        resolve(model, Recipe(target_len=449))
    with pytest.raises(UserError, match="--target-len"):
        resolve(model, Recipe(seq_len=100))


def test_t5_decoder_length_is_its_own(tmp_path):
    model = _config(tmp_path, T5)
    recipe = Recipe(batch_size=2, seq_len=64, target_len=16)
    batch = resolve(model, recipe).make_batch(2, torch.float32)
    assert tuple(batch["input_ids"].shape) == (2, 64)
    assert tuple(batch["labels"].shape) == (2, 16)
    assert estimate_built(resolve(model, recipe), recipe, "cuda").peak.allocated_bytes > 0


def test_clip_takes_image_and_text_sized_by_its_towers(tmp_path):
    model = _config(tmp_path, CLIP)
    built = resolve(model, Recipe(batch_size=2))
    batch = built.make_batch(2, torch.float32)
    assert tuple(batch["pixel_values"].shape) == (2, 3, 56, 56)
    assert tuple(batch["input_ids"].shape) == (2, 77)
    recipe = Recipe(batch_size=2)
    assert estimate_built(resolve(model, recipe), recipe, "cuda").peak.allocated_bytes > 0
    with pytest.raises(UserError, match="cannot change it"):
        resolve(model, Recipe(input_shape=(3, 64, 64)))


def test_llava_image_tokens_match_what_the_model_checks(tmp_path):
    """Built for real on the CPU, LLaVA itself checks that the image tokens in the text
    match the vision tower's features: (56 / 14)^2 = 16 patches."""
    model = _config(tmp_path, LLAVA)
    built = resolve(model, Recipe(seq_len=8), device="cpu")
    batch = built.make_batch(1, torch.float32)
    assert tuple(batch["input_ids"].shape) == (1, 16 + 8)
    with torch.no_grad():
        built.model(**batch)  # raises if the token count and the features disagree
    recipe = Recipe(seq_len=8, precision="bf16")
    assert estimate_built(resolve(model, recipe), recipe, "cuda").peak.allocated_bytes > 0


def test_target_len_needs_a_decoder(tmp_path):
    with pytest.raises(UserError, match="no decoder"):
        resolve(_config(tmp_path, LLAVA), Recipe(target_len=8))


def test_gemma3_puts_its_pooled_image_tokens_in_the_text(tmp_path):
    """Gemma 3's projector pools the 16 vision patches to ``mm_tokens_per_image`` (4): the
    text holds that many image tokens, not one per patch (which the model refuses, built
    for real on the CPU), and the token types its processor returns mark them."""
    model = _config(tmp_path, TINY_GEMMA3)
    built = resolve(model, Recipe(seq_len=8), device="cpu")
    batch = built.make_batch(1, torch.float32)
    assert tuple(batch["input_ids"].shape) == (1, 4 + 8)
    assert batch["token_type_ids"].tolist() == [[1] * 4 + [0] * 8]
    with torch.no_grad():
        built.model(**batch)  # raises if the token count and the features disagree
    recipe = Recipe(seq_len=8, precision="bf16")
    assert estimate_built(resolve(model, recipe), recipe, "cuda").peak.allocated_bytes > 0
