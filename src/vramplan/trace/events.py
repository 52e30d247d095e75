"""The Trace: every storage a step allocated, when it was freed, and what it was.

A trace is the value passed from the tracer to everything downstream (the summary,
the allocator simulation, the report)::

    >>> weight = Allocation(0, 4096, "parameters", "setup", 0, "fc", "empty", 0, None)
    >>> hidden = Allocation(1, 512, "activations", "forward", 1, "fc", "aten.addmm", 1, 2)
    >>> trace = Trace((weight, hidden), (PhaseMark(0, "setup", 0), PhaseMark(1, "forward", 1)), 3)
    >>> [event.delta for event in trace.events()]
    [4096, 512, -512]
    >>> [a.nbytes for a in trace.live_at(1)], trace.phase_at(2).phase
    ([4096, 512], 'forward')
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from vramplan.result import Component, Phase


@dataclass(frozen=True)
class Allocation:
    """One storage: its size, its category, and the event indices of its birth and death.

    ``free_index`` is ``None`` when the storage outlives the trace (parameters, state).
    """

    id: int
    nbytes: int
    category: Component
    phase: Phase
    iteration: int
    module: str
    op: str
    alloc_index: int
    free_index: int | None
    stream: int = 0


@dataclass(frozen=True)
class PhaseMark:
    """From event ``index`` on, the step is in ``phase`` of ``iteration``."""

    index: int
    phase: Phase
    iteration: int


class Event(NamedTuple):
    """One allocation (+) or free (-) in trace order (a tuple: a trace has many)."""

    index: int
    allocation: Allocation
    is_alloc: bool

    @property
    def delta(self) -> int:
        return self.allocation.nbytes if self.is_alloc else -self.allocation.nbytes


FLOPS_KEY = ("flops", "total")
"""The op-count key under which a FLOP-counting trace keeps its FLOPs (linear in the
blocks, so block repetition scales it like the op counts)."""


@dataclass(frozen=True)
class Trace:
    """All allocations of a traced run, ordered by event index."""

    allocations: tuple[Allocation, ...]
    phases: tuple[PhaseMark, ...]
    event_count: int
    notes: tuple[str, ...] = ()
    module_kinds: dict[str, str] = field(default_factory=dict)
    op_counts: dict[tuple[str, str], int] = field(default_factory=dict)
    """How many times each ATen op ran, keyed by (phase, op name)."""
    markers: tuple = ()
    """``OpMarker``s of library-backed ops (convolutions), for the device model."""
    host_bytes: dict[str, int] = field(default_factory=dict)
    """Peak bytes kept in host RAM instead of on the card, by kind (``trace/offdevice.py``):
    paged optimizer state, offloaded activations."""
    renumbered: bool = False
    """Whether the allocations' ids are their positions in allocation order (a trace
    rebuilt from short ones, ``trace/repeat.py``), not the recorder's (which keeps the ids
    of storages taken off the card: gaps)."""

    def events(self) -> Iterator[Event]:
        """Allocations and frees interleaved in the order they happened (a dictionary
        sorted by index, not a list of every index: a device trace's indices are spread
        out). Of two events written at one index, only the later is kept."""
        by_index: dict[int, Event] = {}
        for alloc in self.allocations:
            by_index[alloc.alloc_index] = Event(alloc.alloc_index, alloc, True)
            if alloc.free_index is not None:
                by_index[alloc.free_index] = Event(alloc.free_index, alloc, False)
        return (by_index[index] for index in sorted(by_index))

    def phase_at(self, index: int) -> PhaseMark:
        """The phase mark in force at an event index."""
        current = self.phases[0]
        for mark in self.phases:
            if mark.index > index:
                break
            current = mark
        return current

    def live_at(self, index: int) -> list[Allocation]:
        """Allocations alive just after event ``index``."""
        return [
            a
            for a in self.allocations
            if a.alloc_index <= index and (a.free_index is None or a.free_index > index)
        ]
