"""A paged 8-bit AdamW step's trace, read off the plain 8-bit Adam step's.

``Adam8bitModel`` (``optimizers.py``) runs the same ops in the same order paged or not:
paging only marks the two states of each parameter of ``min_paged_size`` or more elements
``is_paged``, and the tracer then takes those storages off the card into host memory
(``trace/step.py``, ``trace/offdevice.py``). So the paged trace is the 8-bit one without
those states, their bytes reported as host memory; which storages they are follows from
the order ``_init_state`` allocates in (the two quantization maps before the first 8-bit
parameter; per parameter ``state1``, ``state2`` and, for an 8-bit one, ``absmax1`` and
``absmax2``), checked size by size against the parameters' element counts::

    >>> from vramplan.trace.events import Allocation, PhaseMark, Trace
    >>> def state(i, nbytes):
    ...     return Allocation(i, nbytes, "optimizer_state", "optimizer", 1, "", "zeros", i, None)
    >>> eight = Trace((state(0, 1024), state(1, 1024), state(2, 200_000), state(3, 200_000),
    ...                state(4, 3128), state(5, 3128), state(6, 400), state(7, 400)),
    ...               (PhaseMark(0, "optimizer", 1),), 8)
    >>> paged = paged_from_8bit(eight, [200_000, 100])
    >>> [a.id for a in paged.allocations], paged.host_bytes
    ([0, 1, 4, 5, 6, 7], {'paged_optimizer_state': 400000})
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from vramplan.optimizers import Adam8bitModel
from vramplan.result import Component, Phase
from vramplan.trace.events import Allocation, Trace
from vramplan.trace.offdevice import OFF_DEVICE

PAGED_TERM = OFF_DEVICE["paged"]


def _born(allocation: Allocation) -> int:
    return allocation.alloc_index


def _states(trace: Trace) -> list[Allocation] | None:
    """The first step's allocations in allocation order, or None if any of them is not
    optimizer state (``Adam8bitModel`` allocates nothing else: it updates in place)."""
    first = [a for a in trace.allocations if a.phase == Phase.OPTIMIZER and a.iteration == 1]
    if any(a.category != Component.OPTIMIZER_STATE or a.free_index is not None for a in first):
        return None
    return sorted(first, key=_born)


def _expected(numels: list[int]) -> list[tuple[int, bool]]:
    """(bytes, paged) of each storage ``Adam8bitModel(bits=8, paged=True)`` allocates in
    its first step over parameters of ``numels`` elements, in order.

    >>> _expected([5000, 10])
    [(1024, False), (1024, False), (5000, False), (5000, False), (80, False), (80, False), \
(40, False), (40, False)]
    """
    model = Adam8bitModel
    expected: list[tuple[int, bool]] = []
    maps = False
    for n in numels:
        if n >= model.min_8bit_size:
            if not maps:
                expected += [(model.qmap_entries * 4, False)] * 2
                maps = True
            absmax = -(-n // model.block) * 4
            paged = n >= model.min_paged_size
            expected += [(n, paged), (n, paged), (absmax, False), (absmax, False)]
        else:
            expected += [(n * 4, False), (n * 4, False)]
    return expected


def _groups(sizes: list[int], numels: list[int]) -> list[bool] | None:
    """Which of ``sizes`` (the first step's states with the step in backward: one
    ``Adam8bitModel`` per parameter, stepped in gradient order, each 8-bit one with its own
    two quantization maps) are paged: the one reading of them as per-parameter groups
    whose element counts are ``numels`` (in any order); None where there is none, or
    readings differ.

    >>> _groups([1024, 1024, 200_000, 200_000, 3128, 3128, 40, 40], [10, 200_000])
    [False, False, True, True, False, False, False, False]
    """
    model = Adam8bitModel
    maps = model.qmap_entries * 4
    left = Counter(numels)  # the element counts not read yet: a group must take one
    found: list[list[bool]] = []

    def read(i: int, paged: list[bool]) -> None:
        if len(found) > 1:
            return
        if i == len(sizes):
            if not +left and paged not in found:
                found.append(list(paged))
            return
        n = sizes[i + 2] if i + 5 < len(sizes) else 0
        absmax = -(-n // model.block) * 4
        if (
            left[n]
            and n >= model.min_8bit_size
            and sizes[i : i + 6] == [maps, maps, n, n] + [absmax] * 2
        ):
            on = n >= model.min_paged_size
            left[n] -= 1
            read(i + 6, [*paged, False, False, on, on, False, False])
            left[n] += 1
        pair = sizes[i : i + 2]
        m = pair[0] // 4 if len(pair) == 2 and pair[0] == pair[1] and pair[0] % 4 == 0 else 0
        if left[m] and m < model.min_8bit_size:
            left[m] -= 1
            read(i + 2, [*paged, False, False])
            left[m] += 1

    try:
        read(0, [])
    except RecursionError:
        return None
    return found[0] if len(found) == 1 else None


def paged_from_8bit(trace: Trace, numels: list[int], in_backward: bool = False) -> Trace | None:
    """The trace of the same step under ``paged_adamw_8bit``, from ``trace`` (traced under
    ``adam8bit`` with parameters of ``numels`` elements, those the optimizer holds, in
    its order; ``in_backward``: one optimizer per parameter, stepped in backward); None
    where the first step's storages are not the expected ones."""
    if in_backward:
        states = sorted(
            (
                a
                for a in trace.allocations
                if a.iteration == 1 and a.category == Component.OPTIMIZER_STATE
            ),
            key=_born,
        )
        paged = _groups([a.nbytes for a in states], numels)
        if paged is None or any(a.free_index is not None for a in states):
            return None
    else:
        first = _states(trace)
        expected = _expected(numels)
        if first is None or [a.nbytes for a in first] != [nbytes for nbytes, _ in expected]:
            return None
        states, paged = first, [on for _, on in expected]
    away = {a.id for a, on in zip(states, paged, strict=True) if on}
    if not away:
        return trace
    kept = tuple(a for a in trace.allocations if a.id not in away)
    if trace.renumbered:  # ids are positions: as the rebuild of the paged traces gives them
        kept = tuple(replace(a, id=i) for i, a in enumerate(sorted(kept, key=_born)))
    total = sum(a.nbytes for a in states if a.id in away)  # never freed: all live at once
    return replace(trace, allocations=kept, host_bytes={**trace.host_bytes, PAGED_TERM: total})
