"""Counts kept as dictionaries (op counts, kernel calls): what was counted between two
moments, and more added to them. The copied passes and micro-steps add what they stand
for, and are written only where the policy's FLOP counter can be told their FLOPs too
(``counter_takes_copies``)::

    add_counts(recorder.op_counts, counted_between(before, after))
"""

from __future__ import annotations

from typing import Any


def counted_between(before: dict, after: dict) -> list[tuple[Any, int]]:
    """What was counted between ``before`` and ``after``.

    >>> counted_between({"mm": 1}, {"mm": 3, "add": 1})
    [('mm', 2), ('add', 1)]
    """
    return [(key, n - before.get(key, 0)) for key, n in after.items() if n != before.get(key, 0)]


def add_counts(counts: dict, more: list[tuple[Any, int]]) -> None:
    """Add ``more`` (key, count) pairs to ``counts``, dropping what comes to 0.

    >>> counts = {"mm": 5, "add": 1}
    >>> add_counts(counts, [("mm", 2), ("add", -1)])
    >>> counts
    {'mm': 7}
    """
    for key, count in more:
        counts[key] = counts.get(key, 0) + count
        if not counts[key]:
            del counts[key]


def counter_takes_copies(policy: object) -> bool:
    """Whether the FLOPs of passes written rather than run can be added to ``policy``'s FLOP
    counter: none is kept, or it has ``add`` (``flops.TotalFlops``; PyTorch's
    ``FlopCounterMode`` has not).

    >>> from vramplan.trace.flops import FlopCountingPolicy
    >>> counter_takes_copies(object()), counter_takes_copies(FlopCountingPolicy())
    (True, True)
    """
    counter = getattr(policy, "counter", None)
    return counter is None or hasattr(counter, "add")
