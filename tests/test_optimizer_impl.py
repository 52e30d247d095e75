"""How ``torch.optim`` runs the step changes the optimizer phase's temporaries: foreach
(PyTorch 2.0+'s default on CUDA) keeps one per parameter at once, the per-parameter loop
(the default before 2.0) one tensor's worth, fused none. Ground truth: real CPU runs of
the same step, and the emulated stack picking the default."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vramplan.device.options import device_options
from vramplan.device.stack import parse_stack
from vramplan.errors import UserError
from vramplan.measurement.run import measure_built
from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe
from vramplan.sources.user_code import module_source

WIDTH = 1024  # one 1024x1024 fp32 weight: 4 MiB


def _wide_mlp(layers: int = 4) -> nn.Module:
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)))


def _built(recipe: Recipe, layers: int = 4):
    with torch.device("meta"):
        model = _wide_mlp(layers)
    return module_source(model, recipe.with_changes(input_shape=(WIDTH,)), "wide-mlp")


@pytest.mark.parametrize("impl", ["foreach", "for-loop", "fused"])
def test_traced_optimizer_step_matches_real_cpu_run(impl):
    recipe = Recipe(batch_size=1, optimizer="adamw", optimizer_impl=impl)
    traced = estimate_built(_built(recipe), recipe, target="cpu").peak.allocated_bytes
    real = measure_built(_built(recipe), recipe, "cpu", steps=2).allocated_bytes
    assert abs(traced - real) <= 0.01 * real, (impl, traced, real)


def test_foreach_temporaries_grow_with_the_parameter_count_the_loop_s_do_not():
    weight = WIDTH * WIDTH * 4
    excess = {}
    for impl in ("foreach", "for-loop", "fused"):
        recipe = Recipe(batch_size=1, optimizer="adamw", optimizer_impl=impl)
        for layers in (2, 4):
            peak = estimate_built(_built(recipe, layers), recipe, target="cpu").peak
            state = 4 * layers * weight  # weights, gradients and AdamW's two moments
            excess[impl, layers] = peak.allocated_bytes - state
    # foreach holds a temporary for every second moment at once: two more weights' worth;
    # the loop's temporaries are of one weight at a time; fused keeps none.
    assert excess["foreach", 4] - excess["foreach", 2] >= 2 * weight
    assert abs(excess["for-loop", 4] - excess["for-loop", 2]) < 1024  # step counters
    assert excess["for-loop", 4] < excess["foreach", 4]
    assert excess["fused", 4] < weight


def test_the_emulated_stack_picks_the_default_implementation():
    assert parse_stack("torch2.0-cu11.8").foreach_default
    assert not parse_stack("torch1.13-cu11.7").foreach_default
    recipe = Recipe(batch_size=1, optimizer="adamw")
    peaks = {}
    for stack in ("torch1.13-cu11.7", "torch2.14-cu12.8"):
        options = device_options(gpu="a100", stack=stack)
        estimate = estimate_built(_built(recipe), recipe, "cuda", options)
        peaks[stack] = estimate.peak.allocated_bytes
        assert any("optimizer step" in note for note in estimate.notes)
    forced = recipe.with_changes(optimizer_impl="for-loop")
    loop = estimate_built(_built(forced), forced, "cuda", device_options(gpu="a100"))
    assert peaks["torch1.13-cu11.7"] == loop.peak.allocated_bytes
    assert peaks["torch2.14-cu12.8"] > peaks["torch1.13-cu11.7"]


@pytest.mark.parametrize(
    "knobs,words",
    [
        (dict(optimizer="lion", optimizer_impl="fused"), "torch.optim optimizers"),
        (dict(optimizer="rmsprop", optimizer_impl="fused"), "no fused rmsprop"),
        (dict(optimizer="adamw", optimizer_impl="vectorised"), "optimizer implementation"),
    ],
)
def test_impossible_implementations_are_refused(knobs, words):
    with pytest.raises(UserError, match=words):
        Recipe(**knobs)


@pytest.mark.parametrize("optimizer", ["momentum", "adamw", "lion", "adafactor"])
def test_a_measured_run_keeps_the_weights_it_started_with(optimizer):
    # A real run of random weights on synthetic data can diverge; the NaN boxes of a
    # diverged Faster R-CNN crash RoIAlign's CPU kernel. The measured run steps at
    # learning rate 0: every kernel and state of the step, no change to a weight.
    recipe = Recipe(batch_size=2, optimizer=optimizer, input_shape=(WIDTH,))
    model = _wide_mlp(2)
    before = [p.detach().clone() for p in model.parameters()]
    built = module_source(model, recipe, "wide-mlp", copy_to_meta=False)
    measured = measure_built(built, recipe, "cpu", steps=3)
    assert measured.allocated_bytes >= 2 * sum(p.numel() * 4 for p in before)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
