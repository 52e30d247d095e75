"""The second micro-step of gradient accumulation written from the first.

Under ``--grad-accum`` an iteration runs a second forward and backward pass before its
optimizer step (``loop.MAX_MICRO_STEPS``). It runs the same ops on the same shapes as the
first. Only each parameter's ``AccumulateGrad`` differs: the first pass keeps the incoming
gradient as ``param.grad`` (PyTorch steals it, no copy), the second adds it into that one in
place (``grad += new``) and frees it. ``MicroStepCopy`` watches the first micro-step and
writes the second into the recorder as it would have run: the first's events renumbered,
each kept gradient's copy freed where its accumulation ran, and one ``add_`` per
accumulation in place of the first's ops there. Where the first micro-step kept anything
but the gradients, freed an older storage, did not start without gradients, or copied a
gradient instead of keeping it, the second is traced in full::

    copy = MicroStepCopy(recorder, params, policy)
    with copy.watching():
        run_steps(..., copies_micro_step=copy.copies)

Not used where a micro-step does more than its passes (offloaded activations, the optimizer
step in backward, a distributed engine, compiled blocks, Keras's ``zero_grad`` after the
forward pass): ``micro_steps_copyable`` says so before the run.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch

from vramplan.recipe import Recipe
from vramplan.result import Component, Phase
from vramplan.trace.counts import add_counts, counted_between, counter_takes_copies
from vramplan.trace.policy import DevicePolicy
from vramplan.trace.recorder import AllocationRecorder, StorageRecord


def micro_steps_copyable(
    recipe: Recipe, policy: DevicePolicy, engine: object, keras: bool = False
) -> bool:
    """Whether a run of this recipe may have its second micro-step written from the first:
    a training step with gradient accumulation whose passes do nothing else.

    >>> from vramplan.trace.policy import CudaPolicy
    >>> micro_steps_copyable(Recipe(grad_accum=4), CudaPolicy(), None)
    True
    >>> micro_steps_copyable(Recipe(grad_accum=4, activation_offload=True), CudaPolicy(), None)
    False
    """
    return (
        counter_takes_copies(policy)
        and recipe.is_training
        and recipe.grad_accum > 1
        and not (recipe.activation_offload or recipe.optimizer_in_backward or recipe.compile)
        and engine is None
        and not keras
    )


@dataclass
class _Accumulation:
    """One parameter's ``AccumulateGrad`` in the first micro-step."""

    incoming: StorageRecord | None  # the gradient it was handed
    counts: dict  # op counts, kernel calls and FLOPs as it began
    kept: StorageRecord | None = None  # the parameter's gradient once it ended
    event: int = 0  # the event count once it ended: the second one's free goes there
    markers: int = 0  # the markers recorded by then
    ops: list = field(default_factory=list)  # what it counted


class MicroStepCopy:
    """Watches each iteration's first micro-step and writes its second one."""

    def __init__(
        self, recorder: AllocationRecorder, params: list[torch.nn.Parameter], policy: DevicePolicy
    ) -> None:
        self.recorder = recorder
        self.params = [p for p in params if p.requires_grad]
        self.policy = policy
        self.counter = getattr(policy, "counter", None)  # FLOPs (``flops.py``)
        self.accumulations: list[_Accumulation] = []
        self._open: dict[int, _Accumulation] = {}  # by parameter, between its two hooks
        self._start: dict | None = None  # counts as the first micro-step began
        self.reason = ""

    def _counts(self) -> dict:
        recorder = self.recorder
        return {
            "events": recorder.event_count,
            "markers": len(recorder.markers),
            "phases": len(recorder.phases),
            "ops": dict(recorder.op_counts),
            "kernels": dict(self.policy.kernel_calls()),
            "flops": self.counter.get_total_flops() if self.counter is not None else 0,
        }

    # -- watching the first micro-step ---------------------------------------------------
    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Hooks on each trainable parameter around its ``AccumulateGrad``: what it was
        handed, what it kept, and what it counted."""
        handles = []
        for param in self.params:
            handles.append(param.register_hook(self._handed(param)))
            handles.append(param.register_post_accumulate_grad_hook(self._accumulated))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _handed(self, param: torch.nn.Parameter):
        def hook(grad: torch.Tensor) -> None:
            if self._start is not None:
                incoming = self.recorder.record_for(grad)
                self._open[id(param)] = _Accumulation(incoming, self._counts())

        return hook

    def _accumulated(self, param: torch.nn.Parameter) -> None:
        if self._start is None:
            return
        accumulation = self._open.pop(id(param), None)
        if accumulation is None:
            self.reason = self.reason or "a gradient was accumulated without its hook"
            return
        now = self._counts()
        accumulation.kept = self.recorder.record_for(param.grad)
        accumulation.event, accumulation.markers = now["events"], now["markers"]
        accumulation.ops = counted_between(accumulation.counts["ops"], now["ops"])
        if (
            accumulation.kept is None
            or accumulation.kept is not accumulation.incoming
            or now["kernels"] != accumulation.counts["kernels"]
            or now["flops"] != accumulation.counts["flops"]
        ):
            self.reason = self.reason or "a gradient was copied, not kept, by AccumulateGrad"
        self.accumulations.append(accumulation)

    # -- the second micro-step ------------------------------------------------------------
    def copies(self, iteration: int, micro_step: int) -> bool:
        """Whether ``micro_step`` (0, 1) of ``iteration`` is written instead of run: the
        second, when the first left only its gradients behind. The first one is watched."""
        if micro_step == 0:
            self.accumulations, self._open, self.reason = [], {}, ""
            if any(p.grad is not None for p in self.params):
                self._start = None  # gradients kept from before: not the first micro-step
                return False
            self._start = self._counts()
            return False
        if micro_step != 1 or self._start is None:
            return False
        end = self._counts()
        self.reason = self.reason or self._leftover(end["events"])
        if not self.reason:
            self._write(self._start, end)
        self._start = None
        return not self.reason

    def _leftover(self, end: int) -> str:
        """Why the first micro-step cannot stand for the second ('' if it can)."""
        start = self._start["events"]
        kept = {id(a.kept) for a in self.accumulations}
        if self._open:
            return "a gradient's accumulation did not end"
        grads = [self.recorder.record_for(p.grad) for p in self.params if p.grad is not None]
        if len(kept) != len(self.accumulations) or {id(g) for g in grads} != kept:
            return "the gradients kept are not those accumulated, once each"
        for record in self.recorder.records:
            born, died = record.alloc_index, record.free_index
            if born < start:
                if died is not None and start <= died < end:
                    return f"{record.op}, made before the micro-step, died in it"
            elif id(record) in kept:
                if not (start <= born < end and died is None):
                    return f"the gradient {record.op} did not live on"
            elif died is None or died >= end:
                return f"{record.op}, made in the micro-step, outlives it"
        return ""

    # -- writing the copy ------------------------------------------------------------------
    def _write(self, start: dict, end: dict) -> None:
        """Append the second micro-step's events, phase marks, markers and counts."""
        recorder = self.recorder
        m0, m1 = start["events"], end["events"]
        frees = [a.event for a in self.accumulations]  # non-decreasing: hook order

        def moved(index: int) -> int:  # an event of the first micro-step
            return m1 + index - m0 + bisect.bisect_right(frees, index)

        freed_at = {id(a.kept): m1 + a.event - m0 + k for k, a in enumerate(self.accumulations)}
        born = [r for r in recorder.records if r.alloc_index >= m0]
        for record in born:
            kept = id(record) in freed_at
            recorder.records.append(
                StorageRecord(
                    id=len(recorder.records),
                    key=-1,
                    nbytes=record.nbytes,
                    phase=record.phase,
                    iteration=record.iteration,
                    module=record.module,
                    op=record.op,
                    alloc_index=moved(record.alloc_index),
                    free_index=freed_at[id(record)] if kept else moved(record.free_index),
                    tags=set(record.tags) - {Component.GRADIENTS} if kept else set(record.tags),
                    stream=record.stream,
                )
            )
        recorder.phases.extend(
            replace(mark, index=m1 + mark.index - m0 + bisect.bisect_left(frees, mark.index))
            for mark in recorder.phases[start["phases"] - 1 : end["phases"]]
            if mark.index >= m0
        )
        recorder.markers.extend(
            replace(marker, index=self._marker_index(marker.index, n, m0, m1) - 1)
            for n, marker in enumerate(
                recorder.markers[start["markers"] : end["markers"]], start["markers"]
            )
        )
        recorder.event_count = m1 + (m1 - m0) + len(frees)
        ops = counted_between(start["ops"], end["ops"])
        for accumulation in self.accumulations:
            ops += [(key, -n) for key, n in accumulation.ops]
        ops += [((Phase.BACKWARD, "add_"), len(self.accumulations))]
        add_counts(recorder.op_counts, ops)
        add_counts(self.policy.kernel_calls(), counted_between(start["kernels"], end["kernels"]))
        if self.counter is not None:
            self.counter.add(end["flops"] - start["flops"])

    def _marker_index(self, index: int, position: int, m0: int, m1: int) -> int:
        """The event count at a copied marker: the first one's, moved past the frees that
        came before it (an accumulation that ended at its count before it was made)."""
        count = index + 1
        before = sum(
            1
            for a in self.accumulations
            if a.event < count or (a.event == count and a.markers <= position)
        )
        return m1 + count - m0 + before
