"""A workbench that estimates a model under many recipes, counting, timing and caching
traces::

bench = Workbench("torchvision:resnet18", device_options(gpu="t4"))
bench.estimate(Recipe(batch_size=64)).verdict.status   # 'fits'; traced once, then cached
bench.log.seconds()                                    # (2.1,): how long each trace took

A ``TraceLog`` times every trace and tells an optional ``progress(event)`` callback when
each one starts and ends (the command line's progress line, ``report/progress.py``).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from vramplan.collector import settle
from vramplan.device.catalog import GpuSpec
from vramplan.device.measured import measured_for
from vramplan.device.options import DeviceOptions
from vramplan.device.profile import profile_for
from vramplan.device.replay import apply_device
from vramplan.distributed.facts import facts_of
from vramplan.distributed.fsdp import engine_for, with_traced_layout
from vramplan.distributed.layout import ModelFacts, ParallelLayout, check_layout, per_rank
from vramplan.errors import UserError
from vramplan.pipeline import (
    cuda_policy,
    estimate_built,
    estimate_from_trace,
    estimate_traced,
    flop_counting_policy,
    trace_and_estimate,
)
from vramplan.recipe import Recipe
from vramplan.result import Component, Estimate, Phase
from vramplan.sources import BuiltModel, resolve
from vramplan.trace.events import FLOPS_KEY, Trace
from vramplan.trace.materialize import unique_parameters
from vramplan.trace.packed import PackedTrace
from vramplan.trace.paged import paged_from_8bit
from vramplan.trace.tricks import head_name, offload_candidates

RESIDENT = (Component.PARAMETERS, Component.BUFFERS, Component.GRADIENTS, Component.OPTIMIZER_STATE)
"""What a step holds whatever its batch (``Workbench.resident_bytes``)."""


def recipe_key(recipe: Recipe) -> str:
    return json.dumps(recipe.to_json(), sort_keys=True)


def describe(recipe: Recipe) -> str:
    """A short label of a recipe: ``batch 8, seq 4096, bf16, adamw, checkpointing 4``; the
    planner's other levers are named when they are on, so that no two traces of a plan
    read alike.

    >>> describe(Recipe(batch_size=8, seq_len=4096, precision="bf16"))
    'batch 8, seq 4096, bf16, adamw'
    >>> describe(Recipe(batch_size=8, optimizer_impl="fused", activation_offload=True))
    'batch 8, fp32, adamw fused, activation offloading'
    """
    parts = [f"batch {recipe.batch_size}"]
    if recipe.seq_len is not None:
        parts.append(f"seq {recipe.seq_len}")
    parts.append(recipe.precision)
    if recipe.quantize != "none":
        parts.append(f"{recipe.quantize} weights")
    if recipe.is_training:
        impl = "" if recipe.optimizer_impl == "auto" else f" {recipe.optimizer_impl}"
        parts.append(recipe.optimizer + impl)
        if recipe.lora_rank:
            parts.append(f"LoRA r{recipe.lora_rank}")
        if recipe.optimizer_in_backward:
            parts.append("step in backward")
        if recipe.activation_offload:
            parts.append("activation offloading")
        if recipe.loss_chunks:
            parts.append(f"loss in {recipe.loss_chunks} chunks")
        if recipe.checkpointing != "none":
            parts.append(f"checkpointing {recipe.checkpointing}")
        if recipe.grad_accum > 1:
            parts.append(f"grad-accum {recipe.grad_accum}")
    else:
        parts.append("inference")
    return ", ".join(parts)


def trace_label(model: str, recipe: Recipe, what: str = "") -> str:
    """What a trace is, for the progress line and the trace list: ``hf:gpt2: FLOPs, batch 8,
    ...``."""
    return f"{model}: {what + ', ' if what else ''}{describe(recipe)}"


@dataclass(frozen=True)
class TraceEvent:
    """One trace as a progress callback sees it: ``seconds`` is None as it starts and its
    duration once it has ended; ``index`` counts the log's traces from 1."""

    label: str
    index: int
    seconds: float | None = None

    @property
    def done(self) -> bool:
        return self.seconds is not None


STEP_ONLY = (
    "batch_size",
    "grad_accum",
    "checkpointing",
    "activation_offload",
    "optimizer",
    "optimizer_impl",
    "optimizer_in_backward",
    "loss_chunks",
    "zero_grad",
)
"""Recipe fields that change how a step runs and not the model built for it."""

BUILD_FREE = (
    "grad_accum",
    "checkpointing",
    "activation_offload",
    "optimizer_impl",
    "optimizer_in_backward",
    "zero_grad",
)
"""Recipe fields no model source reads (``sources/`` reads ``batch_size``, ``optimizer`` and
``loss_chunks`` of ``STEP_ONLY``): recipes that differ only in them trace one build."""


KEPT_BUILDS = 8
"""Builds ``traced_build`` keeps (the latest used): a 70B QLoRA build holds 18 MiB."""


def build_key(recipe: Recipe) -> str:
    """What a build to trace is kept under (``Workbench.traced_build``).

    >>> build_key(Recipe(grad_accum=4, checkpointing="full")) == build_key(Recipe())
    True
    >>> build_key(Recipe(optimizer="sgd")) == build_key(Recipe())
    False
    """
    data = recipe.to_json()
    for name in BUILD_FREE:
        data.pop(name, None)
    return json.dumps(data, sort_keys=True, default=str)


@dataclass
class TraceLog:
    """Every trace a session runs, with what it was and how long it took (build, trace and
    device replay together); ``progress(event)`` is told as each starts and ends."""

    progress: Callable[[TraceEvent], None] | None = None
    records: list[tuple[str, float]] = field(default_factory=list)
    side_by_side: int = 0
    """Of the records, how many were traced in worker processes (``add``)."""

    def timed(self, label: str, run: Callable[[], Any]) -> Any:
        """``run()``, timed and reported under ``label``."""
        index = len(self.records) + 1
        if self.progress is not None:
            self.progress(TraceEvent(label, index))
        start = time.perf_counter()
        result = run()
        seconds = time.perf_counter() - start
        self.records.append((label, seconds))
        if self.progress is not None:
            self.progress(TraceEvent(label, index, seconds))
        return result

    def add(self, label: str, seconds: float) -> None:
        """A trace run elsewhere (a worker process, ``parallel.py``), reported as done."""
        index = len(self.records) + 1
        self.records.append((label, seconds))
        self.side_by_side += 1
        if self.progress is not None:
            self.progress(TraceEvent(label, index))
            self.progress(TraceEvent(label, index, seconds))

    def __len__(self) -> int:
        return len(self.records)

    def seconds(self) -> tuple[float, ...]:
        return tuple(seconds for _, seconds in self.records)

    def since(self, count: int) -> tuple[tuple[str, float], ...]:
        """The records after the first ``count``."""
        return tuple(self.records[count:])


@dataclass
class Workbench:
    """Estimates of one model under varying recipes on one device setting, each one rank's
    under ``layout`` (one GPU by default): FSDP traced through FSDP2 on a fake process
    group, ZeRO/TP/PP by the layout formulas over the single-GPU trace, as
    ``Session.estimate`` does with a layout."""

    model: str
    device: DeviceOptions
    build: Callable[[str, Recipe], BuiltModel] = resolve
    log: TraceLog = field(default_factory=TraceLog)
    finish: Callable[[Estimate, Trace, DeviceOptions], Estimate] | None = None
    """What the framework's runtime makes of each traced step on a card (TensorFlow's
    memory policy and BFC allocator, ``device/tensorflow.py``); None: PyTorch's."""
    _done: dict[str, tuple[Estimate, Trace | PackedTrace]] = field(default_factory=dict)
    """Each recipe's estimate and trace, by ``key``; a worker's trace stays packed until
    something reads it (``run``: a floor, a FLOP count, another card), most never are."""
    shares_short_traces: bool = False
    _short_traces: dict = field(default_factory=dict)
    counts_flops: bool = False
    """Trace every training step with its FLOPs counted too (``trace/flops.py``): the same
    events, so ``flops`` reads them off the step's own trace instead of tracing it again
    (``plan``'s recompute cost)."""
    jobs: int = 1
    """Processes ``prefetch`` may trace in at once (``parallel.py``); 1: one at a time."""
    _workers: Any = None
    """The worker processes of ``side_by_side`` (``parallel.TraceWorkers``) while it runs."""
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    """The parallel layout every estimate is one rank of."""
    _facts: dict[str, ModelFacts] = field(default_factory=dict)
    _read_only: dict[str, BuiltModel] = field(default_factory=dict)
    """Meta builds kept to read (``model_of``)."""
    _to_trace: dict[str, BuiltModel] = field(default_factory=dict)
    """Meta builds kept to trace again (``traced_build``), by ``build_key``."""

    def __post_init__(self) -> None:
        if self.device.gpu is None:
            raise UserError("planning needs a card: give --gpu NAME or --gpu-memory SIZE")

    @property
    def traces(self) -> int:
        """Traces run so far (FLOP-counting traces of ``plan`` included)."""
        return len(self.log)

    def label(self, recipe: Recipe, what: str = "") -> str:
        return trace_label(self.model, recipe, what)

    def timed(self, recipe: Recipe, run: Callable[[], Any], what: str = "") -> Any:
        """``run()`` (a trace of ``recipe``) timed and reported on the log."""
        return self.log.timed(self.label(recipe, what), run)

    @contextmanager
    def side_by_side(self, first: Recipe) -> Iterator[None]:
        """Within the block, ``prefetch`` traces in ``jobs`` worker processes forked here
        (``parallel.py``); call it before the bench traces anything. The model is built
        for the ``first`` recipe before the fork (no trace: imports and the meta build),
        so that the workers start from it (kept to read: ``model_of``)."""
        if self._workers is not None:
            yield
            return
        from vramplan.planner.parallel import start_workers

        if self.jobs > 1:
            self.model_of(first)
        self._workers = start_workers(self, self.jobs)
        try:
            yield
        finally:
            if self._workers is not None:
                self._workers.close()
            self._workers = None

    @property
    def width(self) -> int:
        """Traces that can run at once now: the live workers of ``side_by_side``, or 1."""
        return (self._workers.jobs if self._workers is not None else 0) or 1

    def prefetch(self, recipes: list[Recipe], ahead: list[Recipe] | None = None) -> None:
        """Start tracing the ``recipes`` not traced yet in the workers of ``side_by_side``
        (none outside it), and as many of ``ahead`` (recipes likely asked for next,
        likeliest first) as workers come free for; asking for them afterwards waits for
        their worker. A single recipe to trace is traced here, now, beside them."""
        if self._workers is None:
            return
        left = self._workers.trace(self._sources(recipes), self._sources(ahead or []))
        if left is not None:
            self.run(left)

    def _sources(self, recipes: list[Recipe]) -> list[Recipe]:
        """The recipes traced for ``recipes`` (a paged optimizer's is read off another)."""
        return [self._read_off(r) or r for r in recipes]

    def has(self, key: str) -> bool:
        """Whether the recipe cached under ``key`` (``Workbench.key``) has been traced."""
        return key in self._done

    def known(self, recipe: Recipe) -> bool:
        """Whether ``recipe``'s estimate is at hand without a trace: traced, or read off
        one traced (a paged optimizer's step)."""
        return self.has(self.key(self._read_off(recipe) or recipe))

    def keep(
        self, recipe: Recipe, estimate: Estimate, trace: PackedTrace, label: str, seconds: float
    ) -> None:
        """A recipe traced in a worker: its estimate and packed trace cached, its trace
        logged."""
        self._done[self.key(recipe)] = estimate, trace
        self.log.add(label, seconds)
        settle()

    def short_traces_made(self) -> dict:
        """The short traces of repeated blocks kept so far (``shares_short_traces``)."""
        return self._short_traces

    def in_worker(self) -> None:
        """This copy of the bench runs in one of its workers (``parallel.py``): it traces
        what it is sent itself, with no workers of its own."""
        self._workers = None

    def use_short_traces(self, store: dict) -> None:
        """Keep short traces in ``store`` from now on (a worker's, shared with the others:
        ``parallel.py``)."""
        self._short_traces = store

    def built(self, recipe: Recipe) -> BuiltModel:
        """The model built (on the meta device) for ``recipe``; with
        ``shares_short_traces`` (``plan``), its repeated blocks' short traces are shared
        between this bench's estimates (``trace/repeat.py``)."""
        built = self.build(self.model, recipe)
        if self.shares_short_traces:
            built.short_traces = self._short_traces
        return built

    def traced_build(self, recipe: Recipe) -> BuiltModel:
        """The build to trace ``recipe`` on, shared with the recipes that differ from it
        only in fields no source reads (``BUILD_FREE``). A trace whose repeated blocks are
        rebuilt from short ones traces cut copies of the model and leaves the build as it
        was (``trace/repeat.py``); ``spent`` drops a build a trace ran on itself. A build of
        a 70B QLoRA model takes a second (peft wraps 560 layers).

        >>> from vramplan.device.options import device_options
        >>> bench = Workbench("torchvision:resnet18", device_options(gpu="T4"))
        >>> plain = bench.traced_build(Recipe(batch_size=2))
        >>> bench.traced_build(Recipe(batch_size=2, grad_accum=4)) is plain
        True
        >>> bench.spent(Recipe(batch_size=2))
        >>> bench.traced_build(Recipe(batch_size=2)) is plain
        False
        """
        key = build_key(recipe)
        built = self._to_trace.pop(key, None) or self.build(self.model, recipe)
        self._to_trace[key] = built  # the latest used last: the oldest go first
        while len(self._to_trace) > KEPT_BUILDS:
            del self._to_trace[next(iter(self._to_trace))]
        built.short_traces = self._short_traces if self.shares_short_traces else None
        return built

    def spent(self, recipe: Recipe) -> None:
        """Forget ``recipe``'s build (``traced_build``): a trace ran on its model itself,
        which it may have changed (checkpointing switched on, casts, FSDP's wrapping)."""
        self._to_trace.pop(build_key(recipe), None)

    def _trace(self, recipe: Recipe, policy: Any, engine: Any, device: DeviceOptions):
        """``trace_and_estimate`` on ``recipe``'s shared build (``traced_build``), given
        up where the trace did not leave it as it was."""
        built = self.traced_build(recipe)
        try:
            estimate, trace = trace_and_estimate(built, recipe, "cuda", device, policy, engine)
        except BaseException:
            self.spent(recipe)
            raise
        if not trace.renumbered:  # traced whole, on the build's own model
            self.spent(recipe)
        return estimate, trace

    def model_of(self, recipe: Recipe) -> BuiltModel:
        """A meta build of ``recipe``'s model to read (its kind, blocks, trainable
        parameters), built once for the recipes that differ only in how the step runs
        (``STEP_ONLY``) and never traced: a trace changes the model it is given
        (checkpointing, casts). A build of a large model takes seconds.

        >>> from vramplan.device.options import device_options
        >>> bench = Workbench("torchvision:resnet18", device_options(gpu="T4"))
        >>> bench.model_of(Recipe(batch_size=2)) is bench.model_of(Recipe(batch_size=8))
        True
        """
        data = recipe.to_json()
        for name in STEP_ONLY:
            data.pop(name, None)
        key = json.dumps(data, sort_keys=True, default=str)
        if key not in self._read_only:
            self._read_only[key] = self.built(recipe)
        return self._read_only[key]

    def under(self, layout: ParallelLayout) -> Workbench:
        """A bench of the same model and card whose estimates are ranks of ``layout``,
        sharing this one's traces and log (a layout applied by formula reuses the single-GPU
        traces); it traces one recipe at a time (the workers trace this bench's layout)."""
        if layout == self.layout:
            return self
        return replace(self, layout=layout, _workers=None)

    def key(self, recipe: Recipe) -> str:
        """What a trace of ``recipe`` is cached under: the recipe, and the sharding engine
        that traces it (none where the layout is one GPU or applied by formula)."""
        engine = engine_for(self.layout)
        return recipe_key(recipe) + ("" if engine is None else f" {engine}")

    def run(self, recipe: Recipe) -> tuple[Estimate, Trace]:
        """The estimate and trace of ``recipe`` as traced (traced once, then cached): one
        GPU's, or under an FSDP layout one rank's (``estimate`` gives the rank's figures)."""
        key = self.key(recipe)
        estimate, trace = self._traced(recipe)
        if isinstance(trace, PackedTrace):  # a worker's, read for the first time
            trace = trace.unpack()
            self._done[key] = estimate, trace
        return estimate, trace

    def _traced(self, recipe: Recipe) -> tuple[Estimate, Trace | PackedTrace]:
        """``run``'s estimate and trace, a worker's trace still packed."""
        key = self.key(recipe)
        if key not in self._done and self._workers is not None:
            self._workers.wait(key)  # a worker traces it
        if key in self._done:
            return self._done[key]
        sibling = self._read_off(recipe)
        if sibling is not None:
            derived = self._paged(recipe, sibling)
            if derived is not None:
                self._done[key] = derived
        if key not in self._done:
            policy = flop_counting_policy(self.device) if self._counted(recipe) else None
            engine = engine_for(self.layout)
            device = self._traced_device()
            what = "" if engine is None else f"FSDP rank of {engine.world_size}"
            with self._tracing_here():
                estimate, trace = self.timed(
                    recipe, lambda: self._trace(recipe, policy, engine, device), what
                )
            if self.finish is not None:
                estimate = self.finish(estimate, trace, device)
            self._done[key] = estimate, trace
        settle()  # the cache out of the collector's later passes
        return self._done[key]

    def _tracing_here(self) -> contextlib.AbstractContextManager:
        """Within it, the bench traces a recipe itself: its workers start one trace fewer
        (``parallel.TraceWorkers``)."""
        workers = self._workers
        return workers.tracing_here() if workers is not None else contextlib.nullcontext()

    def _read_off(self, recipe: Recipe) -> Recipe | None:
        """The traced recipe ``recipe``'s step is read off exactly, if any: a paged 8-bit
        AdamW step's is the plain 8-bit Adam step's (``trace/paged.py``), on one GPU's
        trace."""
        if not (recipe.is_training and recipe.optimizer == "paged_adamw_8bit"):
            return None
        if engine_for(self.layout) is not None:
            return None
        return recipe.with_changes(optimizer="adam8bit")

    def _paged(self, recipe: Recipe, sibling: Recipe) -> tuple[Estimate, Trace] | None:
        """``recipe``'s estimate and trace from its plain 8-bit ``sibling``'s (``_read_off``;
        traced, or cached), summarised and replayed on the card as a trace of it would be;
        None where the sibling's first step is not the storages ``paged_from_8bit``
        expects, or the model brings its own optimizer."""
        built = self.model_of(recipe)
        if built.make_optimizer is not None:
            return None
        traced, trace = self.run(sibling)
        numels = [p.numel() for p in unique_parameters(built.model) if p.requires_grad]
        paged = paged_from_8bit(trace, numels, recipe.optimizer_in_backward)
        if paged is None:
            return None
        device = self._traced_device()
        policy = flop_counting_policy(device) if self._counted(recipe) else cuda_policy(device)
        estimate = estimate_traced(built, recipe, paged, device, policy, traced.model)
        if self.finish is not None:
            estimate = self.finish(estimate, paged, device)
        return estimate, paged

    def estimate(self, recipe: Recipe) -> Estimate:
        return self.ranked(recipe, self._traced(recipe)[0])

    def ranked(self, recipe: Recipe, traced: Estimate) -> Estimate:
        """``traced`` (``recipe``'s estimate as ``run`` traced it) as one rank of the
        bench's layout."""
        if self.layout == ParallelLayout():
            return traced
        facts = self._facts.get(recipe_key(recipe))
        if facts is None:
            facts = self._facts[recipe_key(recipe)] = facts_of(self.built(recipe))
        check_layout(self.layout, facts)
        if engine_for(self.layout) is not None:
            return with_traced_layout(traced, self.layout)
        return per_rank(traced, self.layout, facts)

    def resident_bytes(self, recipe: Recipe) -> int | None:
        """Bytes every step that differs from ``recipe`` only in its micro-batch,
        checkpointing or activation offloading holds at some moment: the parameters,
        buffers, gradients and optimizer state alive as ``recipe``'s last optimizer step
        begins (none of them depends on those levers), read off its trace. A floor under
        their allocated peak, so under their device total: where it passes the usable line,
        none of them fits. None where the verdict is not the trace's own (a layout applied
        by formula, TensorFlow's runtime) or the step has no optimizer phase."""
        if not self._judged_on_trace():
            return None
        trace = self.run(recipe)[1]
        starts = [m.index for m in trace.phases if m.phase == Phase.OPTIMIZER]
        if not recipe.is_training or not starts:
            return None
        held = trace.live_at(starts[-1] - 1)  # alive as the last optimizer step begins
        return sum(a.nbytes for a in held if a.category in RESIDENT)

    def offloaded_floor_bytes(self, recipe: Recipe) -> int | None:
        """A floor under the device total of ``recipe``'s step with activation offloading,
        read off ``recipe``'s own trace. Offloading moves the tensors a forward pass saves
        for backward to the host and changes nothing else of the step
        (``trace/tricks.Offloader``): every other storage is alive at the same point of
        the same ops, and the same ops load the same kernels. So the most the step holds
        at once besides the activations offloading may move (``tricks.offload_candidates``),
        with what the card holds outside the allocator (the device total less the reserved
        bytes: the CUDA context, the libraries' kernels), is under the offloaded step's
        device total. Where it passes the usable line, that step does not fit. None where
        the verdict is not the trace's own (``resident_bytes``).

        With every block recomputed the activations are little of a step: an accumulating
        step's weights and gradients, mixed precision's cast weights, the block recomputed
        in backward (offloading's hooks are off there), and what the output head and the
        loss save (the offloader pauses at the head: a large vocabulary's logits) stay.
        """
        if not self._judged_on_trace():
            return None
        trace = self.run(recipe)[1]
        moved = offload_candidates(trace, head_name(self.model_of(recipe).model))
        changes = []  # (event index, frees first, bytes)
        for a in trace.allocations:
            if a.id not in moved:
                changes.append((a.alloc_index, 1, a.nbytes))
                if a.free_index is not None:
                    changes.append((a.free_index, 0, -a.nbytes))
        live = kept = 0
        for _, _, nbytes in sorted(changes):
            live += nbytes
            kept = max(kept, live)
        peak = self.estimate(recipe).peak
        return kept + peak.device_total_bytes - peak.reserved_bytes

    def _judged_on_trace(self) -> bool:
        """Whether the verdict reads the trace's own figures (not a layout applied by
        formula, not TensorFlow's runtime)."""
        return self.finish is None and (
            self.layout == ParallelLayout() or engine_for(self.layout) is not None
        )

    def _traced_device(self, device: DeviceOptions | None = None) -> DeviceOptions:
        """``device`` (the bench's) as the trace sees it: the FSDP engine's ranks."""
        device = device or self.device
        engine = engine_for(self.layout)
        return device if engine is None else replace(device, data_parallel=engine.world_size)

    def _counted(self, recipe: Recipe) -> bool:
        return self.counts_flops and recipe.is_training

    def flops(self, recipe: Recipe) -> int:
        """FLOPs of the traced run (two iterations) under ``recipe``: the whole depth's,
        where blocks were repeated. With ``counts_flops``, those of the step's own (cached)
        trace; otherwise (or when it was traced before counting began) a trace of their
        own."""
        if self._counted(recipe):
            counts = self.run(recipe)[1].op_counts
            if FLOPS_KEY in counts:
                return counts[FLOPS_KEY]
        policy = flop_counting_policy(self.device)
        _, trace = self.timed(  # one GPU's FLOPs: a rank computes the same at its batch
            recipe,
            lambda: trace_and_estimate(self.built(recipe), recipe, "cuda", self.device, policy),
            "FLOPs",
        )
        return trace.op_counts[FLOPS_KEY]

    def sharded(self, recipe: Recipe, engine: Any) -> Estimate:
        """One rank of ``recipe`` traced under a sharding ``engine`` (``Fsdp2``)."""
        device = replace(self.device, data_parallel=engine.world_size)
        return self.timed(
            recipe,
            lambda: estimate_built(self.built(recipe), recipe, "cuda", device, engine),
            f"FSDP rank of {engine.world_size}",
        )

    def fits(self, recipe: Recipe) -> bool:
        return self.estimate(recipe).verdict.status == "fits"

    def on(self, recipe: Recipe, gpu: GpuSpec) -> Estimate:
        """The same traced step judged against another card (with that card's measured
        table, if any); on the bench's own card (the same device options), the estimate it
        was traced with: no second device replay."""
        options = replace(
            self.device,
            gpu=gpu,
            profile=profile_for(gpu.name),
            measured=measured_for(gpu.name, self.device.software.slug),
        )
        if options == self.device:
            return self.estimate(recipe)
        estimate, trace = self.run(recipe)
        tensor_level = estimate_from_trace(trace, estimate.model, recipe, "cuda", list(trace.notes))
        traced_options = self._traced_device(options)
        on_card = apply_device(tensor_level, trace, traced_options)
        if self.finish is not None:
            on_card = self.finish(on_card, trace, traced_options)
        return self.ranked(recipe, on_card)
