"""The largest batch (or context) whose step fits the card with headroom.

Device memory grows close to linearly with the batch, so two traces give a slope and a
prediction of the figure the verdict reads (the high end of the device total's range);
the predicted boundary is traced and then its neighbour, so a good prediction costs four
traces (the first two, and then the predicted boundary with its neighbour, run side by
side where the bench has ``jobs`` to spare: ``parallel.py``). Otherwise each further
trace tightens a bracket [fits, does not fit] by the secant through the nearest points
(bisection when the secant leaves the bracket), until the answer N fits and N+1 does
not::

    result = largest_fitting(bench, Recipe(batch_size=1), "batch_size")
    result.value, result.traces   # the answer, and how many traces it took
"""

from __future__ import annotations

from dataclasses import dataclass

from vramplan.errors import UserError
from vramplan.planner.bench import Workbench
from vramplan.recipe import Recipe
from vramplan.result import Estimate

KNOBS = {
    "batch_size": "batch size",
    "seq_len": "sequence length",
    # --mode generate (trace/generate.py)
    "prompt_len": "prompt length",
    "new_tokens": "new tokens",
}
RESULT_KEYS = {
    "batch_size": "max_batch_size",
    "prompt_len": "max_prompt_len",
    "new_tokens": "max_new_tokens",
}
LIMIT = 1 << 20


@dataclass(frozen=True)
class SearchResult:
    """The answer of a search and what it cost."""

    knob: str
    value: int
    estimate: Estimate
    beyond: Estimate | None
    traces: int
    bisection_traces: int
    traced: tuple[tuple[str, float], ...] = ()
    """What each trace was and its seconds (build, trace and device replay)."""
    side_by_side: int = 0
    """Of the traces, how many ran in worker processes (``--jobs``, ``parallel.py``)."""

    @property
    def trace_seconds(self) -> tuple[float, ...]:
        return tuple(seconds for _, seconds in self.traced)

    def to_json(self) -> dict:
        key = RESULT_KEYS.get(self.knob, "max_seq_len")
        data = {
            "schema": "vramplan.max_batch/1",
            key: self.value,
            "knob": self.knob,
            "traces": self.traces,
            "bisection_traces": self.bisection_traces,
            "trace_seconds": [round(seconds, 3) for seconds in self.trace_seconds],
            "trace_labels": [label for label, _ in self.traced],
            "traces_side_by_side": self.side_by_side,
            "estimate": self.estimate.to_json(timeline=False),
        }
        if self.beyond is not None:
            data["next"] = {
                "value": self.value + 1,
                "device_total_bytes": self.beyond.peak.device_total_bytes,
                "status": self.beyond.verdict.status,
            }
        return data


def _measure(estimate: Estimate) -> int:
    """The figure the verdict compares with the usable line (the high end of the range)."""
    return estimate.verdict.compared_bytes


def _predict(a: tuple[int, int], b: tuple[int, int], target: int) -> int | None:
    """The largest value whose prediction on the line through ``a`` and ``b`` stays under
    ``target``; ``None`` when the line does not rise."""
    (x0, y0), (x1, y1) = sorted((a, b))
    if x1 == x0 or y1 <= y0:
        return None
    return int(x0 + (target - y0) * (x1 - x0) / (y1 - y0))


def bisection_cost(first: int, answer: int) -> int:
    """Traces a doubling-then-bisection search from ``first`` needs to find ``answer``
    (what trial-and-error batch finders do, one run per trial).

    >>> bisection_cost(1, 86)   # 1, 2, 4, ..., 128, then 6 halvings between 64 and 128
    14
    """
    doublings, upper = 1, first
    while upper <= answer:
        upper *= 2
        doublings += 1
    return doublings + max(1, (upper - upper // 2).bit_length() - 1)


def largest_fitting(
    bench: Workbench, recipe: Recipe, knob: str = "batch_size", start: int | None = None
) -> SearchResult:
    """Search ``knob`` (batch_size or seq_len) for the largest value that fits."""
    if knob not in KNOBS:
        raise UserError(f"cannot search {knob!r}; choose one of: {', '.join(KNOBS)}")
    with bench.side_by_side(recipe.with_changes(**{knob: start or 1})):
        return _search(bench, recipe, knob, start)


def _search(bench: Workbench, recipe: Recipe, knob: str, start: int | None) -> SearchResult:
    first = start or 1
    before, side_before = bench.traces, bench.log.side_by_side
    base = recipe.with_changes(**{knob: first})
    bench.prefetch([base, recipe.with_changes(**{knob: first * 2})])
    if not bench.fits(base):
        raise UserError(_cannot_fit_message(bench, base, knob))
    usable = bench.estimate(base).verdict.usable_bytes
    points = {first: _measure(bench.estimate(base))}
    low, high = first, None
    candidate, width = first * 2, None
    while high is None or high - low > 1:
        candidate = max(low + 1, min(candidate, high - 1 if high else LIMIT))
        estimate = bench.estimate(recipe.with_changes(**{knob: candidate}))
        points[candidate] = _measure(estimate)
        if estimate.verdict.status == "fits":
            low = candidate
        else:
            high = candidate
        if low >= LIMIT:
            break
        if high is None:
            below = max(x for x in points if x < low)
            predicted = _predict((below, points[below]), (low, points[low]), usable)
            # where the line puts the boundary at or before ``low``, try its neighbour
            candidate = low * 2 if predicted is None else max(predicted, low + 1)
            # the predicted boundary and its neighbour: side by side where cores allow
            bench.prefetch([recipe.with_changes(**{knob: n}) for n in (candidate, candidate + 1)])
            continue
        # Safeguarded secant: memory is a step function of the knob (allocator segments),
        # so when a step does not halve the bracket, the next one bisects.
        halved = width is None or high - low <= width // 2
        width = high - low
        predicted = _predict((low, points[low]), (high, points[high]), usable) if halved else None
        if predicted is None or not low < predicted < high:
            predicted = (low + high) // 2
        candidate = predicted
    beyond = bench.estimate(recipe.with_changes(**{knob: high})) if high == low + 1 else None
    return SearchResult(
        knob,
        low,
        bench.estimate(recipe.with_changes(**{knob: low})),
        beyond,
        bench.traces - before,
        bisection_traces=bisection_cost(first, low),
        traced=bench.log.since(before),
        side_by_side=bench.log.side_by_side - side_before,
    )


def _cannot_fit_message(bench: Workbench, recipe: Recipe, knob: str) -> str:
    estimate = bench.estimate(recipe)
    verdict = estimate.verdict
    layout = estimate.details.get("parallel", {}).get("layout")
    gpu = f"{verdict.gpu} (one rank of {layout})" if layout else verdict.gpu
    missing = verdict.compared_bytes - verdict.usable_bytes
    if missing <= 0:  # enough on the card, but the allocator runs out (TensorFlow's limit)
        limit = estimate.details.get("tensorflow", {}).get("memory_limit_bytes")
        within = f"TensorFlow's memory limit of {limit:,} bytes" if limit else "the card"
        return (
            f"{bench.model} does not fit {gpu} even at {KNOBS[knob]} "
            f"{getattr(recipe, knob)}: the allocator runs out within {within}; "
            "try `vramplan plan` for levers"
        )
    central = verdict.central_bytes
    return (
        f"{bench.model} does not fit {gpu} even at {KNOBS[knob]} "
        f"{getattr(recipe, knob)}: the high end of its range needs "
        f"{verdict.compared_bytes:,} bytes (central {central:,}), "
        f"{missing:,} more than the {verdict.usable_bytes:,} usable after "
        f"{verdict.headroom:.0%} headroom; try `vramplan plan` for levers"
    )
