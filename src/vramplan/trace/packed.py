"""A trace packed to cross from a worker process to the bench, unpacked where it is read.

A plan's workers (``planner/parallel.py``) send back each recipe's estimate and trace, but
the bench reads few of those traces again (floors, a paged optimizer's sibling, another
card): most trials need only the estimate. Unpickling a Llama-3-70B step's trace (some
100,000 allocations) takes 0.44 s of the bench's time, so a worker pickles the
trace itself and the bench unpickles it only when it is read::

    >>> from vramplan.trace.events import Allocation, PhaseMark, Trace
    >>> trace = Trace((Allocation(0, 512, "activations", "forward", 1, "", "mm", 0, 1),),
    ...               (PhaseMark(0, "forward", 1),), 2)
    >>> PackedTrace.of(trace).unpack() == trace
    True

The bytes come only from a worker this process forked (never from a file or a user).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

from vramplan.trace.events import Trace


@dataclass(frozen=True)
class PackedTrace:
    """A trace pickled by the process that made it."""

    data: bytes

    @classmethod
    def of(cls, trace: Trace) -> PackedTrace:
        return cls(pickle.dumps(trace, pickle.HIGHEST_PROTOCOL))

    def unpack(self) -> Trace:
        return pickle.loads(self.data)  # written by a worker of this plan
