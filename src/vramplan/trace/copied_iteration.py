"""The second iteration's forward and backward passes written from the first's.

A training step runs the same ops on the same shapes every iteration, so the second
iteration's passes allocate and free what the first's did, shifted in time, provided the
first left nothing behind: every storage its passes made is gone once ``zero_grad`` has
run, no older storage died during them, and ``zero_grad`` freed only their storages (the
gradients). ``IterationCopy`` checks that when the first iteration ends. Then the second
runs only its optimizer step, which differs (the first step created the state), on
gradients remade with the first ones' shapes; ``write`` puts the first passes' events,
renumbered, where the second's would have been, and ``zero_grad``'s frees of their
gradients after the step. Where a check fails, the second iteration is traced in full::

    copy = IterationCopy(recorder, params, policy)
    run_steps(..., mark_phase=copy.marking(mark), after_optimizer=copy.stepped,
              skips_passes=copy.skips)
    copy.write()  # the trace equals a traced second iteration, event for event

With the optimizer step in backward (``tricks.step_in_backward``) each parameter's step
runs inside the backward pass, and the first steps create the state. There the second
iteration's steps are run after the first iteration, one per parameter in the same order on
a remade gradient, and ``write`` puts each where the first iteration's step stood in the
copied passes (its state allocations left out, since the state exists by then).

Not used where an iteration carries state into the next one by design (a distributed
engine, compiled blocks, gradients kept by ``zero_grad``): ``copyable`` says so before
the run.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from vramplan.optimizers import step_hooks
from vramplan.recipe import Recipe
from vramplan.result import Phase
from vramplan.trace.counts import add_counts, counted_between, counter_takes_copies
from vramplan.trace.events import PhaseMark
from vramplan.trace.policy import DevicePolicy
from vramplan.trace.recorder import AllocationRecorder, StorageRecord


def copyable(
    recipe: Recipe,
    policy: DevicePolicy,
    engine: object,
    optimizer: object,
    set_to_none: bool,
    keras: bool = False,
) -> bool:
    """Whether a run of this recipe may have its second iteration's passes copied: not
    when an iteration carries state into the next one by design (``keras``: gradients
    cleared after the next forward pass), nor under a FLOP counter that cannot be told the
    copied passes' FLOPs (only ``flops.TotalFlops`` can).

    >>> from vramplan.trace.policy import CudaPolicy
    >>> copyable(Recipe(), CudaPolicy(), None, object(), True)
    True
    >>> copyable(Recipe(), CudaPolicy(), None, object(), False)
    False
    """
    if not counter_takes_copies(policy):
        return False
    if recipe.mode == "generate" or engine is not None or recipe.compile or keras:
        return False
    if not recipe.is_training:
        return True
    return set_to_none and (optimizer is not None or recipe.optimizer_in_backward)


@dataclass
class _Span:
    """Counts taken at one moment of the run: events, markers, op counts, the policy's
    kernel calls, FLOPs."""

    events: int
    markers: int
    op_counts: dict
    kernel_calls: dict
    flops: int


Gradient = tuple[torch.nn.Parameter, torch.Size, tuple, torch.dtype]
"""A parameter and the size, strides and dtype of its gradient."""


@dataclass
class _Step:
    """One optimizer step run as a parameter's gradient arrived (the step in backward)."""

    optimizer: Any
    gradient: Gradient | None  # the gradient it stepped on
    phase: Phase  # the phase its storages were recorded in (backward)
    start: _Span
    end: _Span | None = None


class IterationCopy:
    """Watches the first iteration of a traced run and writes the second one's passes
    (``in_backward``: the optimizer steps run inside the backward pass)."""

    def __init__(
        self,
        recorder: AllocationRecorder,
        params: list[torch.nn.Parameter],
        policy: DevicePolicy,
        in_backward: bool = False,
    ) -> None:
        self.recorder = recorder
        self.params = params
        self.policy = policy
        self.in_backward = in_backward
        self.counter = getattr(policy, "counter", None)  # FLOPs (``flops.py``)
        self.start: _Span | None = None  # the first iteration's passes begin
        self.end: _Span | None = None  # ... and end (its optimizer step begins)
        self.stepped_at: int | None = None  # its optimizer step ends, zero_grad begins
        self.cleared: _Span | None = None  # zero_grad ends: the second iteration begins
        self.gradients: list[Gradient] = []
        self.first_steps: list[_Step] = []  # steps inside the first passes
        self.second_steps: list[_Step] = []  # their second steps, run after them
        self._steps: list[_Step] | None = None  # where a step starting now is kept
        self.copied = False
        self.reason = ""

    def _span(self) -> _Span:
        recorder = self.recorder
        flops = self.counter.get_total_flops() if self.counter is not None else 0
        calls = dict(self.policy.kernel_calls())
        return _Span(
            recorder.event_count, len(recorder.markers), dict(recorder.op_counts), calls, flops
        )

    # -- watching the first iteration ------------------------------------------------
    def marking(self, mark: Callable[[Phase, int], None]) -> Callable[[Phase, int], None]:
        """``mark`` (the run's phase marker), noting where the first iteration's passes
        begin and end."""

        def marked(phase: Phase, iteration: int) -> None:
            if iteration == 1 and phase == Phase.FORWARD and self.start is None:
                self.start = self._span()
                self._steps = self.first_steps
            elif iteration == 1 and phase == Phase.OPTIMIZER:
                self.end = self._span()
                self._steps = None
                self.gradients = [g for p in self.params if (g := self._gradient(p))]
            mark(phase, iteration)

        return marked

    def stepped(self) -> None:
        """Called after each optimizer step: the first one's end is where zero_grad starts."""
        if self.stepped_at is None:
            self.stepped_at = self.recorder.event_count

    @contextlib.contextmanager
    def watching_steps(self) -> Iterator[None]:
        """Note each optimizer step run inside the passes (the step in backward)."""

        def before(optimizer) -> None:
            if self._steps is not None:
                gradient = self._gradient(optimizer.param_groups[0]["params"][0])
                if gradient is None:
                    self.reason = "an optimizer stepped in the passes without a gradient"
                phase = self.recorder.current_phase()[0]
                self._steps.append(_Step(optimizer, gradient, phase, self._span()))

        def after(_optimizer) -> None:
            if self._steps is not None:
                self._steps[-1].end = self._span()

        with step_hooks(before, after):
            yield

    def _gradient(self, param: torch.nn.Parameter) -> Gradient | None:
        """What remaking ``param``'s gradient takes (None: it has none)."""
        grad = param.grad
        if grad is None:
            return None
        if grad.layout != torch.strided or is_traceable_wrapper_subclass(grad):
            self.reason = "a gradient is not a plain strided tensor"
        return param, grad.size(), grad.stride(), grad.dtype

    def _remake(self, gradient: Gradient) -> None:
        """Give the parameter a gradient of the first one's shape, its events unrecorded
        (``write`` writes the copied ones)."""
        param, size, stride, dtype = gradient
        with self.recorder.paused():
            grad = torch.empty_strided(size, stride, dtype=dtype, device=param.device)
        self.recorder.adopt(grad)
        param.grad = grad

    # -- the second iteration ----------------------------------------------------------
    def skips(self, iteration: int) -> bool:
        """Whether ``iteration``'s passes are copied instead of run: the second one, when
        the first left nothing behind. Remakes its gradients (unrecorded) if so, and with
        the step in backward runs its steps."""
        if iteration != 2 or self.start is None:
            return False
        if self.end is None:  # inference: the passes are the whole iteration
            self.end = self._span()
        if self.stepped_at is None:  # no optimizer step after the passes
            self.stepped_at = self.recorder.event_count
        self.cleared = self._span()
        self.reason = self.reason or self._leftover()
        if self.reason:
            return False
        if self.in_backward:
            self._step_again()
        else:
            for gradient in self.gradients:
                self._remake(gradient)
        self.copied = True
        return True

    def _step_again(self) -> None:
        """Each first step's second one, on a remade gradient. Its ops are counted in the
        phase the first one ran in (backward), not in the optimizer phase they run in
        here; the profiler range around it, as the first step's, is in the copied passes."""
        self._steps = self.second_steps
        counts = self.recorder.op_counts
        try:
            for first in self.first_steps:
                self._remake(first.gradient)
                before = dict(counts)
                first.optimizer.step()
                first.gradient[0].grad = None  # (zero_grad's ops are in the copied passes)
                second = self.second_steps[-1]
                add_counts(counts, [(key, -n) for key, n in counted_between(before, counts)])
                ran = counted_between(second.start.op_counts, second.end.op_counts)
                add_counts(counts, [((first.phase, op), n) for (_, op), n in ran])
        finally:
            self._steps = None

    def _leftover(self) -> str:
        """Why the first iteration's passes cannot stand for the second's ('' if they can)."""
        f0, b1 = self.start.events, self.end.events
        s1, z1 = self.stepped_at, self.cleared.events
        steps = _Segments([(s.start.events, s.end.events) for s in self.first_steps])

        def within(index: int | None, low: int, high: int) -> bool:
            return index is not None and low <= index < high

        for record in self.recorder.records:
            born, died = record.alloc_index, record.free_index
            in_passes = f0 <= born < b1
            if in_passes and steps.find(born) is not None:  # state, or a step's temporary
                if died is not None and steps.find(died) != steps.find(born):
                    return f"{record.op}, made in an optimizer step, outlives it"
                continue
            if not in_passes and within(died, f0, b1):
                return f"{record.op}, made before the passes, died in them"
            if in_passes and (died is None or within(died, b1, s1)):
                return f"{record.op}, made in the passes, outlives them"
            if in_passes and steps.find(died) is not None:
                return f"an optimizer step freed {record.op}"
            if not in_passes and within(died, s1, z1):
                return f"zero_grad freed {record.op}, not made in the passes"
            if born >= s1:
                return "zero_grad allocated"
        return ""

    # -- writing the copy ----------------------------------------------------------------
    def write(self) -> None:
        """Put the copied passes into the recorder, as if the second iteration had run them."""
        if not self.copied:
            return
        recorder = self.recorder
        f0, b1, z1 = self.start.events, self.end.events, self.cleared.events
        pieces = self._pieces()
        length = sum(high - low for low, high in pieces)
        stepped_again = sum(s.end.events - s.start.events for s in self.second_steps)
        shift = length - stepped_again  # for the events after the second steps
        cleared = recorder.event_count + shift  # where the copied zero_grad's frees go
        layout = _Segments(pieces)
        offsets = [z1 + sum(h - lo for lo, h in pieces[:n]) for n in range(len(pieces))]

        def copied(index: int | None) -> int | None:
            if index is None:
                return None
            if f0 <= index < b1 or z1 <= index < z1 + stepped_again:
                n = layout.find(index)
                return offsets[n] + index - pieces[n][0]
            return index - self.stepped_at + cleared  # a zero_grad free

        def later(index: int | None) -> int | None:
            if index is None or index < z1:
                return index
            if index < z1 + stepped_again:  # a second step freed it: in the copied passes
                return copied(index)
            return index + shift

        records = recorder.records
        kept = sum(1 for record in records if record.alloc_index < z1)
        repeated = [record for record in records if layout.find(record.alloc_index) is not None]
        phases = {(s.start.events, s.end.events): f.phase for f, s in self._pairs()}
        copies = [
            StorageRecord(
                id=kept + n,
                key=-1,
                nbytes=record.nbytes,
                phase=phases.get(pieces[layout.find(record.alloc_index)], record.phase),
                iteration=2,
                module=record.module,
                op=record.op,
                alloc_index=copied(record.alloc_index),
                free_index=copied(record.free_index),
                tags=set(record.tags),
                stream=record.stream,
            )
            for n, record in enumerate(sorted(repeated, key=lambda r: copied(r.alloc_index)))
        ]
        rest = [record for record in records[kept:] if record.alloc_index >= z1 + stepped_again]
        for record in records:
            record.alloc_index = later(record.alloc_index)
            record.free_index = later(record.free_index)
        for n, record in enumerate(rest):
            record.id = kept + len(copies) + n
        recorder.records = [*records[:kept], *copies, *rest]
        recorder.event_count = cleared + (z1 - self.stepped_at)
        recorder.phases = self._phases(copied, later, stepped_again)
        recorder.markers = self._markers(copied, later)
        add_counts(recorder.op_counts, self._passes("op_counts"))
        add_counts(self.policy.kernel_calls(), self._passes("kernel_calls"))
        if self.counter is not None:
            steps = sum(step.end.flops - step.start.flops for step in self.first_steps)
            self.counter.add(self.end.flops - self.start.flops - steps)

    def _pairs(self) -> list[tuple[_Step, _Step]]:
        return list(zip(self.first_steps, self.second_steps, strict=True))

    def _pieces(self) -> list[tuple[int, int]]:
        """The event ranges the copied passes are made of, in order: the first passes
        between their steps, and the second steps in place of the first ones."""
        pieces, low = [], self.start.events
        for first, second in self._pairs():
            pieces += [(low, first.start.events), (second.start.events, second.end.events)]
            low = first.end.events
        pieces.append((low, self.end.events))
        return pieces

    def _passes(self, field: str) -> list[tuple[Any, int]]:
        """What the copied passes add to a count (``_Span`` ``field``, a dict): the first
        passes' less their steps' (the second steps, run for real, were counted as they
        ran)."""

        def ran(start: _Span, end: _Span) -> list[tuple[Any, int]]:
            return counted_between(getattr(start, field), getattr(end, field))

        counts: dict = {}
        add_counts(counts, ran(self.start, self.end))
        for step in self.first_steps:
            add_counts(counts, [(key, -n) for key, n in ran(step.start, step.end)])
        return list(counts.items())

    def _phases(self, copied, later, stepped_again: int) -> list[PhaseMark]:
        f0, b1, z1 = self.start.events, self.end.events, self.cleared.events
        marks = self.recorder.phases
        inside = _Segments([(s.start.events, s.end.events) for s in self.first_steps])
        return [
            *(mark for mark in marks if mark.index < z1),
            *(
                PhaseMark(copied(m.index), m.phase, 2)
                for m in marks
                if f0 <= m.index < b1 and inside.find(m.index) is None
            ),
            *(
                replace(mark, index=later(mark.index))
                for mark in marks
                if mark.index >= z1 + stepped_again
            ),
        ]

    def _markers(self, copied, later) -> list:
        markers = self.recorder.markers
        first, last, cleared = self.start.markers, self.end.markers, self.cleared.markers
        moved = self.second_steps[-1].end.markers if self.second_steps else cleared
        return [
            *markers[:cleared],
            *(replace(m, index=copied(m.index)) for m in markers[first:last]),
            *(replace(m, index=later(m.index)) for m in markers[moved:]),
        ]


class _Segments:
    """Disjoint ``[low, high)`` event ranges, in any order; ``find`` says which one (its
    position in the list given) holds an index.

    >>> _Segments([(10, 12), (0, 4), (4, 4)]).find(11), _Segments([(0, 4)]).find(4)
    (0, None)
    """

    def __init__(self, ranges: list[tuple[int, int]]) -> None:
        self.ranges = sorted((low, high, n) for n, (low, high) in enumerate(ranges) if high > low)
        self.lows = [low for low, _, _ in self.ranges]

    def find(self, index: int | None) -> int | None:
        if index is None:
            return None
        k = bisect.bisect_right(self.lows, index) - 1
        if k >= 0 and index < self.ranges[k][1]:
            return self.ranges[k][2]
        return None
