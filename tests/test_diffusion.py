"""Diffusion training on precomputed latents: diffusers UNets and DiTs from configs."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch
from conftest import TINY_UNET

from vramplan.errors import UserError
from vramplan.measurement.run import measure_built
from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe
from vramplan.sources import resolve

pytest.importorskip("diffusers")

TINY_DIT = {
    "_class_name": "DiTTransformer2DModel",
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "in_channels": 4,
    "out_channels": 8,
    "num_layers": 2,
    "sample_size": 8,
    "patch_size": 2,
    "num_embeds_ada_norm": 1000,
}


@pytest.fixture
def configs(tmp_path):
    paths = {}
    for name, config in (("unet", TINY_UNET), ("dit", TINY_DIT)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(config))
    return paths


@pytest.mark.parametrize("name", ["unet", "dit"])
def test_a_training_step_matches_a_real_cpu_step(configs, name):
    recipe = Recipe(batch_size=2, optimizer="adamw", seq_len=16)
    spec = f"diffusers:{configs[name]}"
    traced = estimate_built(resolve(spec, recipe), recipe, target="cpu").peak.allocated_bytes
    real = measure_built(resolve(spec, recipe, "cpu"), recipe, "cpu", steps=2).allocated_bytes
    assert traced == pytest.approx(real, rel=0.02)


def test_resolution_sets_the_latents_to_an_eighth(configs):
    built = resolve(f"diffusers:{configs['unet']}", Recipe(resolution=128))
    assert built.default_input_shape == (4, 16, 16)
    with pytest.raises(UserError, match="multiple of 8"):
        resolve(f"diffusers:{configs['unet']}", Recipe(resolution=100))


def test_the_bundled_sdxl_unet_has_its_published_size():
    built = resolve("diffusers:sdxl-unet", Recipe())
    # Stability AI's SDXL base UNet: 2.6B parameters (2,567,463,684 in its safetensors)
    assert sum(p.numel() for p in built.model.parameters()) == 2_567_463_684
    assert built.default_input_shape == (4, 128, 128)  # 1024 px


def test_a_config_of_another_class_is_refused(tmp_path):
    path = tmp_path / "vae.json"
    path.write_text(json.dumps({"_class_name": "AutoencoderKL"}))
    with pytest.raises(UserError, match="UNet2DConditionModel or DiTTransformer2DModel"):
        resolve(f"diffusers:{path}", Recipe())


def test_num_classes_is_refused_rather_than_ignored(configs):
    # a UNet has no classifier head: --num-classes was read by nothing
    with pytest.raises(UserError, match="--num-classes: a diffusion model has no classifier"):
        resolve(f"diffusers:{configs['unet']}", Recipe(num_classes=10))


def test_a_dit_resolution_of_partial_patches_is_refused_before_tracing(configs):
    # latents 9x9 in 2x2 patches: the DiT's output came back 8x8 and the loss against the
    # 9x9 noise failed inside the trace with a broadcasting error
    with pytest.raises(UserError, match="not whole 2x2 patches of the DiT"):
        resolve(f"diffusers:{configs['dit']}", Recipe(resolution=72))
    whole = resolve(f"diffusers:{configs['dit']}", Recipe(resolution=80))
    assert whole.default_input_shape == (4, 10, 10)


def test_a_pure_bf16_cast_logs_nothing(configs):
    # diffusers' ModelMixin.to(dtype) logged "There are modules in UNet2DConditionModel that
    # should be kept in float32: []" to stderr after every answer (the list is empty)
    from vramplan.trace.storage import cast_parameters

    recipe = Recipe(precision="bf16")
    built = resolve(f"diffusers:{configs['unet']}", recipe)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("diffusers.models.modeling_utils")
    logger.addHandler(handler)
    try:
        cast_parameters(built.model, recipe)
    finally:
        logger.removeHandler(handler)
    assert {p.dtype for p in built.model.parameters()} == {torch.bfloat16}
    assert [r.getMessage() for r in records] == []


def test_building_a_model_prints_nothing_from_bitsandbytes(configs):
    """diffusers' quantizers import bitsandbytes where it is installed; its CPU backend
    warns (on CPUs with AVX-512 BF16) that the ``kernels`` package for its own CPU 4-bit
    matmul is missing, once per process: a fresh process, so that the import happens."""
    pytest.importorskip("bitsandbytes")
    code = (
        "import sys\n"
        "from vramplan.recipe import Recipe\n"
        "from vramplan.sources import resolve\n"
        "resolve('diffusers:' + sys.argv[1], Recipe())\n"
        "assert 'bitsandbytes' in sys.modules\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(configs["unet"])], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "bitsandbytes" not in done.stderr and "kernels" not in done.stderr
