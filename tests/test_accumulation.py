"""Autograd's gradient accumulation in place (``trace/accumulation.py``): where two
gradients meet, the real engine sums into one of them; the trace does too, and its peak is
a real CPU run's (PyTorch's profiler), where the out-of-place sum of fake tensors held a
third gradient (16.8 MB traced against the run's 12.6 MB before)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vramplan.measurement.run import measure_built
from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe
from vramplan.sources.user_code import module_source
from vramplan.trace.policy import CpuPolicy
from vramplan.trace.step import trace_training

WIDTH = 1024


class Shared(nn.Module):
    """One weight used twice: its two gradients meet before it takes them, and the step's
    peak is that meeting (the weight, both gradients; the batch is small)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH))

    def forward(self, x):
        return x @ self.weight + (2 * x) @ self.weight


def _built(recipe: Recipe):
    with torch.device("meta"):
        model = Shared()
    return module_source(model, recipe.with_changes(input_shape=(WIDTH,)), "shared")


RECIPE = Recipe(batch_size=4, optimizer="sgd")
GRADIENT = WIDTH * WIDTH * 4  # the weight's fp32 gradient


def test_the_traced_peak_is_a_real_runs_where_gradients_meet():
    traced = estimate_built(_built(RECIPE), RECIPE, target="cpu").peak.allocated_bytes
    real = measure_built(_built(RECIPE), RECIPE, "cpu", steps=2).allocated_bytes
    assert traced == pytest.approx(real, rel=0.005), (traced, real, GRADIENT)
    assert traced < 3.5 * GRADIENT  # the weight and two gradients, not a third for the sum


def test_the_sum_lives_on_in_the_first_gradients_storage():
    trace = trace_training(_built(RECIPE), RECIPE, CpuPolicy())
    backward = [a for a in trace.allocations if a.phase.value == "backward" and a.iteration == 1]
    (total,) = [a for a in backward if a.op == "add"]
    assert total.nbytes == 0  # no block of its own: the engine's add_ into the first
    live = trace.live_at(total.alloc_index)
    gradients = [a for a in live if a in backward and a.nbytes in (0, GRADIENT)]
    assert sorted(a.nbytes for a in gradients) == [0, GRADIENT, GRADIENT]
    first = min(gradients, key=lambda a: a.alloc_index)
    assert first.category.value == "gradients"  # the weight's .grad: the sum, in its bytes


class Gather(nn.Module):
    """A wide activation indexed with a tensor: ``index``'s backward scatters the gradient
    into zeros the activation's size, the step's peak."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, WIDE))
        self.register_buffer("picked", torch.arange(0, WIDE, 2))

    def forward(self, x):
        return (x @ self.weight)[:, self.picked]


WIDE = 16384
GATHER = Recipe(batch_size=32, optimizer="sgd")


def _gather(device: str = "meta"):
    """The model on the meta device to trace, or on the CPU with its indices to run."""
    with torch.device(device):
        model = Gather()
    recipe = GATHER.with_changes(input_shape=(8,))
    return module_source(model, recipe, "gather", copy_to_meta=device == "meta")


def test_index_backward_scatters_into_its_zeros_as_on_real_tensors():
    """On real tensors ``index_backward`` runs ``_index_put_impl_`` in place into its zeros;
    for fake tensors (a subclass) autograd takes ``index_put`` out of place, which made
    the trace hold a second activation-sized tensor at the step's peak. The trace writes
    it in the zeros' bytes, and its peak is a real CPU run's (PyTorch's profiler)."""
    trace = trace_training(_gather(), GATHER, CpuPolicy())
    backward = [a for a in trace.allocations if a.phase.value == "backward" and a.iteration == 1]
    activation = GATHER.batch_size * WIDE * 4
    assert [a.nbytes for a in backward if a.op == "index_put"] == [0]
    assert [a.op for a in backward if a.nbytes == activation] == ["new_zeros"]
    traced = estimate_built(_gather(), GATHER, target="cpu").peak.allocated_bytes
    real = measure_built(_gather("cpu"), GATHER, "cpu", steps=2).allocated_bytes
    assert traced == pytest.approx(real, rel=0.005), (traced, real, activation)
