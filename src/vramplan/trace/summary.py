"""From a Trace to the numbers people read: peak, breakdown at the peak, modules, timeline.

>>> from vramplan.trace.events import Allocation, PhaseMark
>>> weight = Allocation(0, 4096, "parameters", "setup", 0, "fc", "empty", 0, None)
>>> hidden = Allocation(1, 512, "activations", "forward", 1, "fc", "aten.addmm", 1, 2)
>>> s = summarize_trace(Trace((weight, hidden), (PhaseMark(0, "setup", 0),
...                                              PhaseMark(1, "forward", 1)), 3))
>>> s.peak.allocated_bytes, s.peak.phase, s.components["activations"]
(4608, 'forward', 512)
>>> s.phase_peaks, [m.name for m in s.top_modules]
({'setup': 4096, 'forward': 4608}, ['fc'])
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from vramplan.result import (
    COMPONENTS,
    Component,
    ModuleUsage,
    Peak,
    TimelinePoint,
    empty_components,
)
from vramplan.trace.events import Event, Trace

TIMELINE_POINTS = 400
TOP_MODULES = 10


@dataclass(frozen=True)
class TraceSummary:
    """What ``summarize_trace`` finds in a trace."""

    peak: Peak
    peak_index: int
    components: dict[str, int]
    phase_peaks: dict[str, int]
    phase_components: dict[str, dict[str, int]]
    """Components at the highest point of each phase."""
    top_modules: tuple[ModuleUsage, ...]
    timeline: tuple[TimelinePoint, ...]


def _kept(totals: list[int], phases: list[str], peak_at: list[int], limit: int) -> list[int]:
    """Which points the timeline keeps (at most about ``limit``): the highest of each
    bucket, phase starts and the peak (``peak_at``: the positions of the peak's event)."""
    count = len(totals)
    if count <= limit:
        return list(range(count))
    size = -(-count // limit)
    kept = {0, count - 1}
    for start in range(0, count, size):
        bucket = range(start, min(start + size, count))
        kept.add(max(bucket, key=totals.__getitem__))
    for i in range(1, count):
        if phases[i] != phases[i - 1]:
            kept.add(i)
    kept.update(peak_at)
    return sorted(kept)


def summarize_trace(
    trace: Trace,
    module_kinds: dict[str, str] | None = None,
    events: list[Event] | None = None,
    nbytes: dict[int, int] | None = None,
) -> TraceSummary:
    """Walk the events twice: once for the running totals, once more to read the
    components at the few points kept (the peak, each phase's peak, the timeline).

    ``events``: ``trace.events()`` where the caller has listed them already; ``nbytes``:
    each allocation's size by id where the figures count other sizes than the trace's (the
    device model's block sizes), so the trace need not be copied to resize them."""
    if events is None:
        events = list(trace.events())
    if nbytes is None:
        nbytes = {a.id: a.nbytes for a in trace.allocations}
    marks = trace.phases
    mark_pos = 0
    total = 0
    peak_total, peak_index, peak_at = -1, 0, 0
    totals: list[int] = []
    point_marks = []
    phase_peaks: dict[str, int] = {}
    phase_peak_at: dict[str, int] = {}
    for i, event in enumerate(events):
        while mark_pos + 1 < len(marks) and marks[mark_pos + 1].index <= event.index:
            mark_pos += 1
        mark = marks[mark_pos]
        size = nbytes[event.allocation.id]
        total += size if event.is_alloc else -size
        totals.append(total)
        point_marks.append(mark)
        if total > phase_peaks.get(mark.phase, -1):
            phase_peaks[mark.phase] = total
            phase_peak_at[mark.phase] = i
        if total > peak_total:
            peak_total, peak_index, peak_at = total, event.index, i
    peak_positions = [i for i, e in enumerate(events) if e.index == peak_index] if events else []
    kept = _kept(totals, [m.phase for m in point_marks], peak_positions, TIMELINE_POINTS)
    wanted = set(kept) | set(phase_peak_at.values()) | {peak_at}
    live = empty_components()
    snapshots: dict[int, dict[str, int]] = {}
    for i, event in enumerate(events):
        size = nbytes[event.allocation.id]
        live[event.allocation.category] += size if event.is_alloc else -size
        if i in wanted:
            snapshots[i] = dict(live)
    peak_components = snapshots.get(peak_at, dict(live)) if events else dict(live)
    phase_components = {phase: snapshots[i] for phase, i in phase_peak_at.items()}
    points = [
        TimelinePoint(events[i].index, point_marks[i].phase, point_marks[i].iteration, snapshots[i])
        for i in kept
    ]
    peak_mark = trace.phase_at(peak_index)
    peak = Peak(
        allocated_bytes=max(peak_total, 0), phase=peak_mark.phase, iteration=peak_mark.iteration
    )

    by_module: dict[str, int] = defaultdict(int)
    for alloc in trace.live_at(peak_index):
        if alloc.category == Component.ACTIVATIONS:
            by_module[alloc.module or "(outside modules)"] += nbytes[alloc.id]
    kinds = module_kinds or {}
    top = sorted(by_module.items(), key=lambda kv: (-kv[1], kv[0]))[:TOP_MODULES]
    top_modules = tuple(ModuleUsage(name, kinds.get(name, ""), held) for name, held in top)
    return TraceSummary(
        peak=peak,
        peak_index=peak_index,
        components={name: peak_components.get(name, 0) for name in COMPONENTS},
        phase_peaks=dict(phase_peaks),
        phase_components=phase_components,
        top_modules=top_modules,
        timeline=tuple(points),
    )
