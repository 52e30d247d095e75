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
from vramplan.trace.events import Trace

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


def _downsample(points: list[TimelinePoint], peak_index: int, limit: int) -> list[TimelinePoint]:
    """Keep at most ``limit`` points: the highest of each bucket, phase starts and the peak."""
    if len(points) <= limit:
        return points
    size = -(-len(points) // limit)
    kept = {0, len(points) - 1}
    for start in range(0, len(points), size):
        bucket = range(start, min(start + size, len(points)))
        kept.add(max(bucket, key=lambda i: points[i].total))
    for i in range(1, len(points)):
        if points[i].phase != points[i - 1].phase:
            kept.add(i)
    kept.update(i for i, p in enumerate(points) if p.index == peak_index)
    return [points[i] for i in sorted(kept)]


def summarize_trace(trace: Trace, module_kinds: dict[str, str] | None = None) -> TraceSummary:
    """Walk the events once, tracking live bytes per component."""
    live = empty_components()
    total = 0
    peak_total, peak_index = -1, 0
    peak_components = dict(live)
    phase_peaks: dict[str, int] = {}
    phase_components: dict[str, dict[str, int]] = {}
    points: list[TimelinePoint] = []
    marks = trace.phases
    mark_pos = 0
    for event in trace.events():
        while mark_pos + 1 < len(marks) and marks[mark_pos + 1].index <= event.index:
            mark_pos += 1
        mark = marks[mark_pos]
        live[event.allocation.category] += event.delta
        total += event.delta
        point = TimelinePoint(event.index, mark.phase, mark.iteration, dict(live))
        if total > phase_peaks.get(mark.phase, -1):
            phase_peaks[mark.phase] = total
            phase_components[mark.phase] = point.components
        points.append(point)
        if total > peak_total:
            peak_total, peak_index, peak_components = total, event.index, dict(live)
    peak_mark = trace.phase_at(peak_index)
    peak = Peak(
        allocated_bytes=max(peak_total, 0), phase=peak_mark.phase, iteration=peak_mark.iteration
    )

    by_module: dict[str, int] = defaultdict(int)
    for alloc in trace.live_at(peak_index):
        if alloc.category == Component.ACTIVATIONS:
            by_module[alloc.module or "(outside modules)"] += alloc.nbytes
    kinds = module_kinds or {}
    top = sorted(by_module.items(), key=lambda kv: (-kv[1], kv[0]))[:TOP_MODULES]
    top_modules = tuple(ModuleUsage(name, kinds.get(name, ""), nbytes) for name, nbytes in top)
    return TraceSummary(
        peak=peak,
        peak_index=peak_index,
        components={name: peak_components.get(name, 0) for name in COMPONENTS},
        phase_peaks=dict(phase_peaks),
        phase_components=phase_components,
        top_modules=top_modules,
        timeline=tuple(_downsample(points, peak_index, TIMELINE_POINTS)),
    )
