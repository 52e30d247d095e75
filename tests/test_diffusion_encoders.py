"""Diffusion training with the frozen VAE and text encoder in the step, as diffusers'
``train_text_to_image.py`` runs it (``--diffusion-encoders frozen``).

Ground truth: real CPU steps of the same tiny pipeline (PyTorch's own allocator
statistics through ``measure_built``), and the bytes of the frozen weights.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_UNET

from vramplan.errors import UserError
from vramplan.measurement.run import measure_built
from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe
from vramplan.sources import resolve

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

VAE = {  # four blocks: downsamples by 8 as Stable Diffusion's
    "_class_name": "AutoencoderKL",
    "block_out_channels": [8, 8, 16, 16],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "layers_per_block": 1,
    "norm_num_groups": 4,
    "latent_channels": 4,
    "in_channels": 3,
    "out_channels": 3,
    "sample_size": 32,
}
TEXT = {
    "architectures": ["CLIPTextModel"],
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "max_position_embeddings": 77,
    "vocab_size": 100,
    "projection_dim": 32,
}


@pytest.fixture
def pipeline(tmp_path):
    for folder, config in (("unet", TINY_UNET), ("vae", VAE), ("text_encoder", TEXT)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text(json.dumps(config))
    return f"diffusers:{tmp_path / 'unet'}"


def test_a_step_through_the_frozen_encoders_matches_a_real_cpu_step(pipeline):
    recipe = Recipe(batch_size=1, optimizer="adamw", seq_len=8, diffusion_encoders="frozen")
    traced = estimate_built(resolve(pipeline, recipe), recipe, target="cpu")
    real = measure_built(resolve(pipeline, recipe, "cpu"), recipe, "cpu", steps=2)
    assert traced.peak.allocated_bytes == pytest.approx(real.allocated_bytes, rel=0.02)
    assert any("frozen VAE and text encoder" in note for note in traced.notes)
    models = resolve(pipeline, recipe).model  # the frozen weights stay on the card
    weights = sum(p.numel() * p.element_size() for p in models.parameters())
    assert traced.components["parameters"] == weights


def test_only_the_unet_trains_and_the_frozen_weights_take_the_weight_dtype(pipeline):
    recipe = Recipe(batch_size=1, precision="amp-fp16", diffusion_encoders="frozen")
    models = resolve(pipeline, recipe).model
    trainable = {p.dtype for p in models.parameters() if p.requires_grad}
    assert trainable == {torch.float32}
    assert sum(p.numel() for p in models.parameters() if p.requires_grad) == sum(
        p.numel() for p in models.unet.parameters()
    )
    for frozen in (models.vae, models.text_encoder):
        assert {p.dtype for p in frozen.parameters()} == {torch.float16}
        assert not any(p.requires_grad for p in frozen.parameters())
    models.train()
    assert models.unet.training and not models.vae.training and not models.text_encoder.training


def test_the_bundled_sd15_encoders_have_their_published_sizes():
    models = resolve("diffusers:sd15-unet", Recipe(diffusion_encoders="frozen")).model
    # CLIP ViT-L/14's text tower 123,060,480 parameters; the SD VAE 83,653,863
    assert sum(p.numel() for p in models.text_encoder.parameters()) == 123_060_480
    assert sum(p.numel() for p in models.vae.parameters()) == 83_653_863


def test_models_without_bundled_encoders_are_refused(tmp_path):
    with pytest.raises(UserError, match="SDXL"):
        resolve("diffusers:sdxl-unet", Recipe(diffusion_encoders="frozen"))
    (tmp_path / "unet").mkdir()
    (tmp_path / "unet" / "config.json").write_text(json.dumps(TINY_UNET))
    with pytest.raises(UserError, match="vae/config.json"):
        resolve(f"diffusers:{tmp_path / 'unet'}", Recipe(diffusion_encoders="frozen"))
    with pytest.raises(UserError, match="diffusion encoders"):
        Recipe(diffusion_encoders="cached")
