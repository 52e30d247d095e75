"""The max-batch search (a line through two traces, then the predicted boundary and its
neighbour) finds the same batch as tracing every batch size in turn, with fewer traces."""

from __future__ import annotations

from vramplan.device.options import device_options
from vramplan.planner.bench import Workbench
from vramplan.planner.search import largest_fitting
from vramplan.recipe import Recipe

# The runtime floor's high end leaves the tiny CNN room for a batch in the tens here.
CARD = "1800MiB"


def test_search_equals_the_exhaustive_answer(tiny_cnn):
    recipe = Recipe(batch_size=1, input_shape=(3, 32, 32), optimizer="sgd")
    searched = largest_fitting(Workbench(tiny_cnn, device_options(gpu_memory=CARD)), recipe)
    exhaustive = Workbench(tiny_cnn, device_options(gpu_memory=CARD))
    batch = 1
    while exhaustive.estimate(recipe.with_changes(batch_size=batch)).verdict.status == "fits":
        batch += 1
    assert 1 < searched.value == batch - 1
    assert searched.traces < batch and searched.traces <= searched.bisection_traces
