"""diffusers' DiT: its 28 alike blocks traced once, though its first block's ``norm1.emb``
runs again after the last block (``DiTTransformer2DModel.forward``)."""

from __future__ import annotations

import json

import pytest
from conftest import assert_same_estimate

from vramplan.device.options import device_options
from vramplan.pipeline import trace_and_estimate
from vramplan.recipe import Recipe
from vramplan.sources import resolve

pytest.importorskip("diffusers")

TINY_DIT = {
    "_class_name": "DiTTransformer2DModel",
    "activation_fn": "gelu-approximate",
    "attention_bias": True,
    "attention_head_dim": 16,
    "in_channels": 4,
    "norm_elementwise_affine": False,
    "norm_type": "ada_norm_zero",
    "num_attention_heads": 2,
    "num_embeds_ada_norm": 1000,
    "num_layers": 6,
    "out_channels": 8,
    "patch_size": 2,
    "sample_size": 8,
}


@pytest.fixture(autouse=True)
def _short_runs_repeat_too(monkeypatch):
    """The tiny DiT has 6 blocks; repetition's threshold is a speed policy."""
    monkeypatch.setattr("vramplan.trace.repeat.MIN_BLOCKS", 5)


@pytest.mark.parametrize(
    "knobs",
    [{}, {"precision": "amp-bf16"}, {"checkpointing": "full", "precision": "bf16"}],
)
def test_dit_blocks_repeat_and_equal_the_full_trace(tmp_path, knobs):
    path = tmp_path / "dit.json"
    path.write_text(json.dumps(TINY_DIT))
    recipe = Recipe(batch_size=2, optimizer="adamw", **knobs)
    device = device_options(gpu="a100-80gb")
    results = []
    for repeat in (False, True):
        built = resolve(f"diffusers:{path}", recipe)
        built.repeat_blocks = repeat
        results.append(trace_and_estimate(built, recipe, "cuda", device))
    full, repeated = results
    note = "repeated blocks: traced 2 and 3 of the 6 transformer_blocks blocks"
    assert_same_estimate(full, repeated, note)
