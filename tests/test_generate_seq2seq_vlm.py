"""``--mode generate`` of encoder-decoder models: the cross-attention cache holds
2 × decoder layers × heads × head dim × encoder length × dtype bytes, the self-attention
cache grows by 2 × decoder layers × heads × head dim × dtype bytes a new token, and a real
``generate`` of a tiny T5 on the CPU leaves the same cache bytes behind; a LLaVA prompt
counts its image tokens, as a real ``generate`` of a tiny LLaVA does."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_TEXT, TINY_VISION

from vramplan import Session, UserError

DECODER_LAYERS, HEADS, HEAD_DIM, VOCAB = 3, 4, 8, 128
T5 = {
    "model_type": "t5",
    "architectures": ["T5ForConditionalGeneration"],
    "vocab_size": VOCAB,
    "d_model": 32,
    "d_kv": HEAD_DIM,
    "d_ff": 64,
    "num_layers": DECODER_LAYERS,  # transformers 5.23's generate sizes the cache by it
    "num_decoder_layers": DECODER_LAYERS,
    "num_heads": HEADS,
    "decoder_start_token_id": 0,
    "pad_token_id": 0,
    "eos_token_id": 1,
}
WHISPER = {
    "model_type": "whisper",
    "architectures": ["WhisperForConditionalGeneration"],
    "vocab_size": VOCAB,
    "num_mel_bins": 8,
    "d_model": 32,
    "encoder_layers": DECODER_LAYERS,
    "decoder_layers": DECODER_LAYERS,
    "num_hidden_layers": DECODER_LAYERS,
    "encoder_attention_heads": HEADS,
    "decoder_attention_heads": HEADS,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "max_source_positions": 30,
    "max_target_positions": 64,
    "decoder_start_token_id": 2,
    "pad_token_id": 0,
    "eos_token_id": 1,
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    def write(data: dict) -> str:
        path = tmp_path_factory.mktemp("encdec") / "config.json"
        path.write_text(json.dumps(data))
        return f"hf:{path}"

    return write


def _generation(model: str, **knobs) -> dict:
    return Session(model).estimate(mode="generate", **knobs).details["generation"]


def _per_token(dtype_bytes: int, batch: int) -> int:
    """One token of every decoder layer's keys and values."""
    return 2 * DECODER_LAYERS * HEADS * HEAD_DIM * dtype_bytes * batch


@pytest.mark.parametrize(("precision", "dtype_bytes"), [("fp32", 4), ("bf16", 2)])
def test_the_t5_caches_follow_the_formulas(model_path, precision, dtype_bytes):
    """Cross-attention sized by the prompt (encoder length), self-attention by the decoder
    tokens fed (the start token and all new tokens but the last), growing a token a step."""
    model, batch, prompt = model_path(T5), 2, 20
    runs = [
        _generation(model, batch_size=batch, prompt_len=prompt, new_tokens=n, precision=precision)
        for n in (5, 6, 7)
    ]
    per_token = _per_token(dtype_bytes, batch)
    for n, g in zip((5, 6, 7), runs, strict=True):
        assert g["cross_cache_bytes"] == per_token * prompt
        assert g["self_cache_bytes"] == per_token * n
        assert g["kv_cache_bytes"] == per_token * (prompt + n)
    growth = [
        b["self_cache_bytes"] - a["self_cache_bytes"] for a, b in zip(runs, runs[1:], strict=False)
    ]
    assert growth == [per_token, per_token]


def test_the_whisper_cross_cache_is_sized_by_the_encoder_positions(model_path):
    """Whisper's encoder halves its 2 × 30 mel frames to ``max_source_positions`` (30)."""
    g = _generation(model_path(WHISPER), new_tokens=4)
    assert g["cross_cache_bytes"] == _per_token(4, 1) * WHISPER["max_source_positions"]
    assert g["self_cache_bytes"] == _per_token(4, 1) * 4


def test_the_cache_matches_a_real_t5_generate_on_the_cpu(model_path):
    """transformers' own generate with random weights: the storage bytes of every layer's
    keys and values in its EncoderDecoderCache, self- and cross-attention."""
    import transformers

    batch, prompt, new = 2, 12, 6
    config = transformers.T5Config(**{k: v for k, v in T5.items() if k != "model_type"})
    model = transformers.T5ForConditionalGeneration(config).eval()
    ids = torch.randint(2, VOCAB, (batch, prompt))
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            return_dict_in_generate=True,
        )
    assert out.sequences.shape == (batch, 1 + new)  # the start token, then the new ones

    def stored(cache) -> int:
        return sum(
            t.untyped_storage().nbytes()
            for layer in cache.layers
            for t in (layer.keys, layer.values)
        )

    g = _generation(model_path(T5), batch_size=batch, prompt_len=prompt, new_tokens=new)
    assert g["cross_cache_bytes"] == stored(out.past_key_values.cross_attention_cache)
    assert g["self_cache_bytes"] == stored(out.past_key_values.self_attention_cache)


def test_what_the_encoder_decoder_trace_does_not_model_is_refused(model_path):
    t5, whisper = model_path(T5), model_path(WHISPER)
    with pytest.raises(UserError, match="dynamic cache only"):
        _generation(t5, new_tokens=4, cache="static")
    with pytest.raises(UserError, match="greedy decoding"):
        _generation(t5, new_tokens=4, num_beams=2)
    with pytest.raises(UserError, match="--new-tokens 2 or more"):
        _generation(t5, new_tokens=1)
    with pytest.raises(UserError, match="leave out --prompt-len"):
        _generation(whisper, prompt_len=100, new_tokens=4)


LLAVA = {
    "model_type": "llava",
    "architectures": ["LlavaForConditionalGeneration"],
    "image_token_id": 95,
    "vision_feature_layer": -1,
    "vision_feature_select_strategy": "default",
    "vision_config": TINY_VISION,
    "text_config": {**TINY_TEXT, "model_type": "llama"},
}


def test_a_llava_prompt_counts_its_image_tokens_as_a_real_generate_does(model_path):
    """One 56 × 56 image is (56 / 14)^2 = 16 image tokens before the text: transformers'
    own generate on the CPU (random weights) leaves a cache of 16 + text + new - 1 tokens,
    2 layers × 2 KV heads × head dim 8 × fp32 each."""
    import transformers

    batch, text, new, images = 2, 8, 5, 16
    config = transformers.LlavaConfig(**{k: v for k, v in LLAVA.items() if k != "model_type"})
    model = transformers.LlavaForConditionalGeneration(config).eval()
    ids = torch.cat(
        [torch.full((batch, images), LLAVA["image_token_id"]), torch.randint(0, 95, (batch, text))],
        dim=1,
    )
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            pixel_values=torch.randn(batch, 3, 56, 56),
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    real = sum(
        t.untyped_storage().nbytes()
        for layer in out.past_key_values.layers
        for t in (layer.keys, layer.values)
    )
    estimate = Session(model_path(LLAVA)).estimate(
        mode="generate", batch_size=batch, prompt_len=text, new_tokens=new
    )
    g = estimate.details["generation"]
    assert not any("(--seq-len)" in note for note in estimate.notes)  # training's prompt
    assert g["prompt_tokens"] == images + text
    assert g["kv_cache_tokens"] == images + text + new - 1
    assert g["kv_cache_bytes"] == real == batch * (images + text + new - 1) * 2 * 2 * 2 * 8 * 4
