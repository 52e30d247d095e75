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
    """Near the line the verdict need not be monotonic in the batch (the caching
    allocator's 2 MiB pages and the range's fragmentation term move by a page or two from
    one batch to the next): the search lands on a boundary, a batch that fits with the next
    one not fitting, and on the exhaustive answer wherever the verdicts are monotonic."""
    recipe = Recipe(batch_size=1, input_shape=(3, 32, 32), optimizer="sgd")
    searched = largest_fitting(Workbench(tiny_cnn, device_options(gpu_memory=CARD)), recipe)
    exhaustive = Workbench(tiny_cnn, device_options(gpu_memory=CARD))

    def fits(batch: int) -> bool:
        return exhaustive.estimate(recipe.with_changes(batch_size=batch)).verdict.status == "fits"

    verdicts = [fits(batch) for batch in range(1, searched.value + 2)]
    assert searched.value > 1 and verdicts[-2] and not verdicts[-1]
    first_failure = verdicts.index(False) + 1
    if all(not ok for ok in verdicts[first_failure - 1 :]):
        assert searched.value == first_failure - 1
    assert searched.traces < searched.value + 1
    assert searched.traces <= searched.bisection_traces
