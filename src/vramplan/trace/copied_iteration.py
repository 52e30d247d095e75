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

Not used for what keeps state across iterations by design (a distributed engine, the
step in backward, compiled blocks, gradients kept by ``zero_grad``): ``copyable`` says so
before the run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from vramplan.recipe import Recipe
from vramplan.result import Phase
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
    counter = getattr(policy, "counter", None)
    if counter is not None and not hasattr(counter, "add"):
        return False
    if recipe.mode == "generate" or engine is not None or recipe.compile or keras:
        return False
    if not recipe.is_training:
        return True
    return optimizer is not None and set_to_none and not recipe.optimizer_in_backward


@dataclass
class _Span:
    """Counts taken at one moment of the run: events, markers, op counts, the policy's
    kernel calls, FLOPs."""

    events: int
    markers: int
    op_counts: dict
    kernel_calls: dict
    flops: int


class IterationCopy:
    """Watches the first iteration of a traced run and writes the second one's passes."""

    def __init__(
        self, recorder: AllocationRecorder, params: list[torch.nn.Parameter], policy: DevicePolicy
    ) -> None:
        self.recorder = recorder
        self.params = params
        self.policy = policy
        self.counter = getattr(policy, "counter", None)  # FLOPs (``flops.py``)
        self.start: _Span | None = None  # the first iteration's passes begin
        self.end: _Span | None = None  # ... and end (its optimizer step begins)
        self.stepped_at: int | None = None  # its optimizer step ends, zero_grad begins
        self.cleared: _Span | None = None  # zero_grad ends: the second iteration begins
        self.gradients: list[tuple[torch.nn.Parameter, torch.Size, tuple, torch.dtype]] = []
        self.copied = False
        self.reason = ""

    def _span(self) -> _Span:
        recorder = self.recorder
        flops = self.counter.get_total_flops() if self.counter is not None else 0
        calls = dict(self.policy.kernel_calls())
        return _Span(
            recorder.event_count, len(recorder.markers), dict(recorder.op_counts), calls, flops
        )

    def marking(self, mark: Callable[[Phase, int], None]) -> Callable[[Phase, int], None]:
        """``mark`` (the run's phase marker), noting where the first iteration's passes
        begin and end."""

        def marked(phase: Phase, iteration: int) -> None:
            if iteration == 1 and phase == Phase.FORWARD and self.start is None:
                self.start = self._span()
            elif iteration == 1 and phase == Phase.OPTIMIZER:
                self.end = self._span()
                self.gradients = self._gradients()
            mark(phase, iteration)

        return marked

    def stepped(self) -> None:
        """Called after each optimizer step: the first one's end is where zero_grad starts."""
        if self.stepped_at is None:
            self.stepped_at = self.recorder.event_count

    def _gradients(self) -> list:
        grads = []
        for param in self.params:
            grad = param.grad
            if grad is None:
                continue
            if grad.layout != torch.strided or is_traceable_wrapper_subclass(grad):
                self.reason = "a gradient is not a plain strided tensor"
                return []
            grads.append((param, grad.size(), grad.stride(), grad.dtype))
        return grads

    def skips(self, iteration: int) -> bool:
        """Whether ``iteration``'s passes are copied instead of run: the second one, when
        the first left nothing behind. Remakes its gradients (unrecorded) if so."""
        if iteration != 2 or self.start is None:
            return False
        now = self.recorder.event_count
        if self.end is None:  # inference: the passes are the whole iteration
            self.end = self._span()
            self.stepped_at = now
        self.cleared = self._span()
        self.reason = self.reason or self._leftover()
        if self.reason:
            return False
        with self.recorder.paused():
            for param, size, stride, dtype in self.gradients:
                grad = torch.empty_strided(size, stride, dtype=dtype, device=param.device)
                self.recorder.adopt(grad)  # its events are the copies' (``write``)
                param.grad = grad
        self.copied = True
        return True

    def _leftover(self) -> str:
        """Why the first iteration's passes cannot stand for the second's ('' if they can)."""
        f0, b1 = self.start.events, self.end.events
        s1, z1 = self.stepped_at, self.cleared.events

        def within(index: int | None, low: int, high: int) -> bool:
            return index is not None and low <= index < high

        for record in self.recorder.records:
            born, died = record.alloc_index, record.free_index
            in_passes = f0 <= born < b1
            if not in_passes and within(died, f0, b1):
                return f"{record.op}, made before the passes, died in them"
            if in_passes and (died is None or within(died, b1, s1)):
                return f"{record.op}, made in the passes, outlives them"
            if not in_passes and within(died, s1, z1):
                return f"zero_grad freed {record.op}, not made in the passes"
            if born >= s1:
                return "zero_grad allocated"
        return ""

    def write(self) -> None:
        """Put the copied passes into the recorder, as if the second iteration had run them."""
        if not self.copied:
            return
        recorder = self.recorder
        f0, b1, s1, z1 = self.start.events, self.end.events, self.stepped_at, self.cleared.events
        length = b1 - f0
        cleared = recorder.event_count + length  # where the copied zero_grad's frees go

        def copied(index: int | None) -> int | None:
            if index is None:
                return None
            return index - f0 + z1 if index < b1 else index - s1 + cleared

        def later(index: int | None) -> int | None:
            return index + length if index is not None and index >= z1 else index

        records = recorder.records
        kept = sum(1 for record in records if record.alloc_index < z1)
        copies = [
            StorageRecord(
                id=kept + n,
                key=-1,
                nbytes=record.nbytes,
                phase=record.phase,
                iteration=2,
                module=record.module,
                op=record.op,
                alloc_index=copied(record.alloc_index),
                free_index=copied(record.free_index),
                tags=set(record.tags),
                stream=record.stream,
            )
            for n, record in enumerate(r for r in records if f0 <= r.alloc_index < b1)
        ]
        for record in records:
            record.alloc_index = later(record.alloc_index)
            record.free_index = later(record.free_index)
        for record in records[kept:]:
            record.id += len(copies)
        recorder.records = [*records[:kept], *copies, *records[kept:]]
        recorder.event_count += length + (z1 - s1)
        recorder.phases = self._phases(f0, b1, z1, length)
        recorder.markers = self._markers(f0, z1, length)
        _add_difference(recorder.op_counts, self.start.op_counts, self.end.op_counts)
        _add_difference(self.policy.kernel_calls(), self.start.kernel_calls, self.end.kernel_calls)
        if self.counter is not None:
            self.counter.add(self.end.flops - self.start.flops)

    def _phases(self, f0: int, b1: int, z1: int, length: int) -> list[PhaseMark]:
        marks = self.recorder.phases
        return [
            *(mark for mark in marks if mark.index < z1),
            *(PhaseMark(m.index - f0 + z1, m.phase, 2) for m in marks if f0 <= m.index < b1),
            *(replace(mark, index=mark.index + length) for mark in marks if mark.index >= z1),
        ]

    def _markers(self, f0: int, z1: int, length: int) -> list:
        markers = self.recorder.markers
        first, last, cleared = self.start.markers, self.end.markers, self.cleared.markers
        return [
            *markers[:cleared],
            *(replace(m, index=m.index - f0 + z1) for m in markers[first:last]),
            *(replace(m, index=m.index + length) for m in markers[cleared:]),
        ]


def _add_difference(counts: dict, before: dict, after: dict) -> None:
    """Add to ``counts`` what was counted between ``before`` and ``after``.

    >>> counts = {"mm": 5, "add": 1}
    >>> _add_difference(counts, {"mm": 1}, {"mm": 3, "add": 1})
    >>> counts
    {'mm': 7, 'add': 2}
    """
    for key, count in after.items():
        more = count - before.get(key, 0)
        if more:
            counts[key] = counts.get(key, 0) + more
