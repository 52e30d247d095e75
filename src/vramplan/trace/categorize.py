"""Settle what each traced storage was, once the whole run is known.

Tags gathered while tracing (parameter, buffer, gradient, optimizer state, input) win;
otherwise a storage made in a forward pass that is still alive when that forward pass
ends is an activation (kept for backward), and anything else is a temporary::

    categorize(records, phases, event_count)[0].category   # 'parameters': the first weight
"""

from __future__ import annotations

from collections.abc import Sequence

from vramplan.result import Component, Phase
from vramplan.trace.events import Allocation, PhaseMark
from vramplan.trace.recorder import StorageRecord

TAG_PRIORITY = (
    Component.PARAMETERS,
    Component.BUFFERS,
    Component.OPTIMIZER_STATE,
    Component.GRADIENTS,
    Component.INPUTS,
    Component.KV_CACHE,
)


def _phase_ends(phases: Sequence[PhaseMark], event_count: int) -> list[int]:
    """For each phase mark, the event index where its span ends (exclusive)."""
    ends = [mark.index for mark in phases[1:]]
    ends.append(event_count)
    return ends


def _span_end(record: StorageRecord, phases: Sequence[PhaseMark], ends: list[int]) -> int:
    """End of the forward span in which ``record`` was allocated."""
    low, high = 0, len(phases) - 1
    while low < high:  # last mark with index <= alloc_index
        mid = (low + high + 1) // 2
        if phases[mid].index <= record.alloc_index:
            low = mid
        else:
            high = mid - 1
    end = ends[low]
    # A forward span may be cut into several marks (same phase, same iteration): join them.
    while (
        low + 1 < len(phases)
        and phases[low + 1].phase == Phase.FORWARD
        and phases[low + 1].iteration == phases[low].iteration
    ):
        low += 1
        end = ends[low]
    return end


def category_of(record: StorageRecord, forward_span_end: int | None) -> Component:
    for tag in TAG_PRIORITY:
        if tag in record.tags:
            return tag
    if (
        record.phase == Phase.FORWARD
        and forward_span_end is not None
        and (record.free_index is None or record.free_index >= forward_span_end)
    ):
        return Component.ACTIVATIONS
    return Component.TEMPORARIES


def categorize(
    records: Sequence[StorageRecord], phases: Sequence[PhaseMark], event_count: int
) -> tuple[Allocation, ...]:
    """Freeze traced records into ``Allocation`` values with their final category."""
    ends = _phase_ends(phases, event_count)
    allocations = []
    for record in records:
        span_end = _span_end(record, phases, ends) if record.phase == Phase.FORWARD else None
        allocations.append(
            Allocation(
                id=record.id,
                nbytes=record.nbytes,
                category=category_of(record, span_end),
                phase=record.phase,
                iteration=record.iteration,
                module=record.module,
                op=record.op,
                alloc_index=record.alloc_index,
                free_index=record.free_index,
                stream=record.stream,
            )
        )
    return tuple(allocations)
