"""``zero_grad`` between steps: gradients set to None (PyTorch >= 2.0's default) or zeroed
in place and kept (the default before 2.0, PR #92731), checked against real CPU runs
(PyTorch's profiler) and exact gradient bytes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vramplan.device.options import device_options
from vramplan.errors import UserError
from vramplan.measurement.run import measure_built
from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe
from vramplan.result import Component
from vramplan.sources.user_code import module_source


def wide_mlp() -> nn.Module:
    # Activations are small beside the weights at batch 4, so whether the gradients
    # live through the second forward decides the peak.
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256), nn.Linear(256, 10))


def _built(recipe: Recipe):
    with torch.device("meta"):
        model = wide_mlp()
    return module_source(model, recipe.with_changes(input_shape=(256,)), "wide_mlp")


GRAD_BYTES = 4 * sum(p.numel() for p in wide_mlp().parameters())


@pytest.mark.parametrize("zero_grad", ["none", "zeros"])
def test_traced_peak_matches_real_cpu_run(zero_grad):
    recipe = Recipe(batch_size=4, optimizer="sgd", zero_grad=zero_grad)
    traced = estimate_built(_built(recipe), recipe, target="cpu").peak.allocated_bytes
    real = measure_built(_built(recipe), recipe, "cpu", steps=2).allocated_bytes
    assert abs(traced - real) <= 0.01 * real, (zero_grad, traced, real)


def test_kept_gradients_raise_the_real_peak_by_their_bytes():
    """SGD without momentum keeps no state: with gradients kept, the second forward holds
    weights + every gradient + its activations, so the real peak rises."""
    peaks = {}
    for zero_grad in ("none", "zeros"):
        recipe = Recipe(batch_size=4, optimizer="sgd", zero_grad=zero_grad)
        peaks[zero_grad] = measure_built(_built(recipe), recipe, "cpu", steps=2).allocated_bytes
    assert peaks["zeros"] > peaks["none"]
    assert peaks["zeros"] - peaks["none"] <= GRAD_BYTES


@pytest.mark.parametrize("stack,kept", [("torch1.13-cu11.7", True), ("torch2.0-cu11.8", False)])
def test_stack_decides_whether_gradients_live_at_the_peak(stack, kept):
    """At batch 512 the activations outweigh the gradients, so with gradients freed the
    peak is early in backward, before most exist; kept, all of them are live at it. Every
    gradient of this model is below 1 MiB: its block is its size rounded to 512 B."""
    recipe = Recipe(batch_size=512, optimizer="sgd")
    est = estimate_built(
        _built(recipe), recipe, "cuda", device_options(gpu="a100-40gb", stack=stack)
    )
    rounded = sum(
        -(-4 * p.numel() // 512) * 512 for p in wide_mlp().parameters()
    )  # allocator blocks
    at_peak = est.components[Component.GRADIENTS]
    assert (at_peak == rounded) if kept else (at_peak < rounded), (stack, at_peak, rounded)
    assert any("zero_grad() zeroes" in n for n in est.notes) == kept


def test_explicit_choice_overrides_the_stack():
    recipe = Recipe(batch_size=4, optimizer="sgd", zero_grad="none")
    old = device_options(gpu="a100-40gb", stack="torch1.13-cu11.7")
    est = estimate_built(_built(recipe), recipe, "cuda", old)
    assert not any("zero_grad() zeroes" in n for n in est.notes)


def test_bad_choice_is_a_user_error():
    with pytest.raises(UserError, match="zero_grad"):
        Recipe(zero_grad="sometimes")
