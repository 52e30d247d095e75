"""Run training (or inference) iterations under fake tensors and record them.

Two iterations by default: the optimizer state exists from the first ``step()``, and
the gradients of the second iteration coexist with it::

    trace = trace_training(built, Recipe(batch_size=32), CudaPolicy())
    trace.allocations  # every storage of both iterations, in allocation order
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

from vramplan.errors import UserError
from vramplan.library_logs import quiet_logger
from vramplan.limits import time_limit
from vramplan.optimizers import build_optimizer, optimizer_state_tensors, step_hooks
from vramplan.recipe import Recipe
from vramplan.result import Component, Phase
from vramplan.sources.base import BuiltModel
from vramplan.trace.accumulation import backward_in_place
from vramplan.trace.autograd_fork import note_backward
from vramplan.trace.categorize import categorize
from vramplan.trace.compiled import compile_blocks, compile_note
from vramplan.trace.copied_iteration import IterationCopy, copyable
from vramplan.trace.copied_micro_step import MicroStepCopy, micro_steps_copyable
from vramplan.trace.errors import explain_failure
from vramplan.trace.events import Trace
from vramplan.trace.fake_mode import fake_mode
from vramplan.trace.loop import ITERATIONS, MAX_MICRO_STEPS, frees_gradients, run_steps
from vramplan.trace.materialize import materialize, unique_parameters
from vramplan.trace.modules import ModuleStack
from vramplan.trace.offdevice import host_peaks, off_device
from vramplan.trace.policy import DevicePolicy, entered
from vramplan.trace.recorder import AllocationRecorder, storage_resizes
from vramplan.trace.storage import cast_parameters
from vramplan.trace.tricks import (
    FORWARD_STASH,
    MIN_OFFLOAD_BYTES,
    Offloader,
    step_in_backward,
)


def _tag(recorder: AllocationRecorder, tensors, tag: str) -> None:
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            record = recorder.record_for(tensor)
            if record is not None:
                record.tags.add(tag)


def _tag_optimizer_state(recorder: AllocationRecorder, optimizer) -> None:
    for tensor in optimizer_state_tensors(optimizer):
        record = recorder.record_for(tensor)
        if record is None:
            continue
        # A 0-dim ``step`` counter lives on the host on CUDA (not capturable, not fused).
        record.tags.add("host" if tensor.dim() == 0 else Component.OPTIMIZER_STATE)
        if getattr(tensor, "is_paged", False):  # bitsandbytes' managed memory: pages out
            record.tags.add("paged")


@contextlib.contextmanager
def _optimizer_phase_hooks(recorder: AllocationRecorder, optimizers: list) -> Iterator[None]:
    """Mark every ``optimizer.step()`` (the user's own too) as the optimizer phase, and
    tag the state each optimizer holds after its step."""

    def before(optimizer) -> None:
        recorder.enter_optimizer()
        # Gradients an engine assigned itself (FSDP's sharded gradients) had no hook.
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
        _tag(recorder, grads, Component.GRADIENTS)  # _tag skips the missing (None) ones

    def after(optimizer) -> None:
        recorder.leave_optimizer()
        if optimizer not in optimizers:
            optimizers.append(optimizer)
        _tag_optimizer_state(recorder, optimizer)

    with step_hooks(before, after):
        yield


@dataclass
class TracingSession:
    """The live state of one traced run: the recorder, the module stack, the fake mode."""

    recorder: AllocationRecorder
    modules: ModuleStack
    fake: FakeTensorMode
    policy: DevicePolicy
    notes: list[str] = field(default_factory=list)
    optimizers: list = field(default_factory=list)

    def prepare_model(self, model: nn.Module, engine: Any = None) -> list[nn.Parameter]:
        """Materialise ``model`` as fake tensors, tag its parameters, buffers and gradients.
        A sharded model (``engine``) is materialised through ``to_empty``, which keeps the
        engine's own references to its shards."""
        if engine is None:
            materialize(model)
        else:
            self.fake.allow_non_fake_inputs = True  # meta shards become fake ones
            try:
                model.to_empty(device="cpu")
            finally:
                self.fake.allow_non_fake_inputs = False
            engine.initialise(model)
        params = unique_parameters(model)
        _tag(self.recorder, params, Component.PARAMETERS)
        _tag(self.recorder, model.buffers(), Component.BUFFERS)
        for param in params:
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(
                    lambda p: _tag(self.recorder, [p.grad], Component.GRADIENTS)
                )
        return params

    def tag_inputs(self, batch: Any) -> None:
        _tag(self.recorder, tree_flatten(batch)[0], Component.INPUTS)

    def finish(self) -> Trace:
        """Freeze what was recorded into a Trace."""
        recorder = self.recorder
        recorder.close()
        allocations = categorize(recorder.records, recorder.phases, recorder.event_count)
        away = {r.id for r in recorder.records if off_device(r)}
        if self.policy.step_scalars_on_host():
            away |= {r.id for r in recorder.records if "host" in r.tags}
        if away:
            allocations = tuple(a for a in allocations if a.id not in away)
        return Trace(
            allocations=allocations,
            phases=tuple(recorder.phases),
            event_count=recorder.event_count,
            notes=(*self.notes, *self.policy.trace_notes()),
            module_kinds=dict(self.modules.kinds),
            op_counts=dict(recorder.op_counts),
            markers=tuple(recorder.markers),
            host_bytes=host_peaks(recorder.records),
        )


@contextlib.contextmanager
def tracing(
    model: nn.Module,
    policy: DevicePolicy,
    recipe: Recipe,
    name: str,
    hint: str = "check --input-shape / --seq-len",
) -> Iterator[TracingSession]:
    """Everything a traced run needs, entered in the right order; failures inside become
    one-line ``UserError``s naming the op or the error."""
    modules = ModuleStack()
    modules.name_modules(model)
    counter = policy.flop_counter()
    if counter is not None:
        counter.reset()
    recorder = AllocationRecorder(modules, counter, policy.kernel_scratch())
    session = TracingSession(recorder, modules, fake_mode(), policy)
    if recipe.is_training:
        note_backward()  # forked workers could not run autograd from here on
    try:
        with (
            # FakeTensorMode logs a traceback before re-raising a meta kernel's error; the
            # user gets our one-line explanation instead
            quiet_logger("torch._subclasses.fake_tensor"),
            session.fake,
            session.recorder,
            storage_resizes(session.recorder),
            modules,
            _optimizer_phase_hooks(session.recorder, session.optimizers),
            entered(policy.dispatch_modes(recipe)),
        ):
            yield session
    except (Exception, SystemExit) as exc:  # the user's model failed: say which op and what
        raise explain_failure(exc, name, hint) from None


def check_checkpointing(built: BuiltModel, recipe: Recipe) -> None:
    """Refuse ``--checkpointing`` a model cannot honour: no repeated blocks, or more
    blocks than it has."""
    limit = recipe.checkpoint_blocks
    if built.enable_checkpointing is None or built.blocks == 0:
        raise UserError(
            f"--checkpointing {recipe.checkpointing}: {built.name} has no repeated blocks to "
            "recompute (vramplan checkpoints the members of an nn.Sequential or nn.ModuleList "
            "of one block class, or a transformers model's layers)"
        )
    if limit is not None and limit > built.blocks:
        raise UserError(
            f"--checkpointing {limit}: {built.name} has {built.blocks} repeated blocks; "
            f"give at most {built.blocks}, or full"
        )
    every = recipe.checkpoint_every
    if every > built.blocks:
        raise UserError(
            f"--checkpointing every:{every}: {built.name} has {built.blocks} repeated blocks, "
            "so no block would recompute"
        )


def prepare_model_for(built: BuiltModel, recipe: Recipe) -> list[str]:
    """Apply the recipe to the meta model (dtype, checkpointing, train/eval); return notes."""
    notes = []
    model = built.model
    kept = cast_parameters(model, recipe)
    if kept:
        notes.append(kept)
    if recipe.compile and recipe.is_training:
        notes.append(compile_note(compile_blocks(model), recipe))
    if recipe.checkpointing != "none" and recipe.is_training:
        check_checkpointing(built, recipe)
        built.enable_checkpointing(
            model, recipe.checkpoint_blocks, recipe.checkpoint_every, recipe.checkpoint_ops
        )
    model.train(recipe.is_training)
    if recipe.grad_accum > MAX_MICRO_STEPS:
        notes.append(
            f"gradient accumulation {recipe.grad_accum}: {MAX_MICRO_STEPS} micro-steps per "
            f"iteration stand for {recipe.grad_accum} (memory repeats from the second on)"
        )
    return notes


def _forward_context(
    policy: DevicePolicy, recipe: Recipe, session: TracingSession, model: nn.Module
) -> Callable[[], contextlib.AbstractContextManager]:
    """What each forward pass runs under: the policy's autocast, and with
    ``--activation-offload`` torchtune's saved-tensor offloading (``trace/tricks.py``)."""
    if not (recipe.activation_offload and recipe.is_training):
        return lambda: policy.autocast(recipe)
    offloader = Offloader(session.recorder, model, policy.checkpoint_saves_empty)
    session.notes.append(
        "activation offloading (torchtune's OffloadActivations, streams on): saved tensors "
        f"of {MIN_OFFLOAD_BYTES}+ bytes copied to host memory in forward, back in backward; "
        "the output head and the loss stay on the card; host copies reported as host RAM"
        + _empty_saves_note(policy, recipe)
    )

    @contextlib.contextmanager
    def both() -> Iterator[None]:
        with policy.autocast(recipe), offloader.forward():
            yield

    return both


def _empty_saves_note(policy: DevicePolicy, recipe: Recipe) -> str:
    """What the emulated PyTorch's checkpointing adds to the offloader's count, if anything."""
    if not (policy.checkpoint_saves_empty and recipe.checkpointing != "none"):
        return ""
    return (
        "; each checkpoint saves an empty tensor before its inputs (PyTorch 2.1 to 2.11), "
        f"which the offloader's stash of {FORWARD_STASH} counts"
    )


def trace_training(
    built: BuiltModel, recipe: Recipe, policy: DevicePolicy, engine: Any = None
) -> Trace:
    """Trace ``ITERATIONS`` steps of ``built`` with ``recipe`` under ``policy``; with a
    distributed ``engine`` (``distributed.fsdp.Fsdp2``), as one rank of it."""
    notes = prepare_model_for(built, recipe)
    model = built.model
    with contextlib.ExitStack() as stack:
        stack.enter_context(time_limit(f"the traced step of {built.name}"))
        if engine is not None:
            notes += stack.enter_context(engine.applied(model, recipe))
        session = stack.enter_context(tracing(model, policy, recipe, built.name, built.input_hint))
        if engine is not None:
            stack.enter_context(engine.watching(model, session.recorder, session.notes))
        session.notes.extend(notes + built.notes)
        params = session.prepare_model(model, engine)
        batch = built.make_batch(recipe.batch_size, getattr(torch, recipe.param_dtype_name))
        session.tag_inputs(batch)
        optimizer = None
        if recipe.is_training and recipe.optimizer_in_backward:
            session.notes.append(
                "optimizer step in backward (torchtune's optimizer_in_bwd): one optimizer per "
                "parameter, stepped from its post-accumulate-grad hook, gradient freed at once"
            )
            for each in step_in_backward(params, recipe.optimizer, policy.optimizer_defaults()):
                _tag_optimizer_state(session.recorder, each)
        elif recipe.is_training:
            optimizer = built.make_optimizer and built.make_optimizer(params, recipe)
            optimizer = optimizer or build_optimizer(
                recipe.optimizer, params, policy.optimizer_defaults(), recipe.optimizer_impl
            )
            _tag_optimizer_state(session.recorder, optimizer)  # Adagrad's state is eager
        set_to_none = frees_gradients(recipe, policy.frees_grads)
        if recipe.is_training and not set_to_none:
            session.notes.append(
                "zero_grad() zeroes the gradients in place (PyTorch before 2.0, or "
                "--zero-grad zeros): they stay allocated through the next forward"
            )
        copy = None
        if built.copy_iteration and copyable(
            recipe, policy, engine, optimizer, set_to_none, built.zero_grad_after_forward
        ):
            copy = IterationCopy(session.recorder, params, policy, recipe.optimizer_in_backward)
            stack.enter_context(copy.watching_steps())

        micro = None
        if built.copy_iteration and micro_steps_copyable(
            recipe, policy, engine, built.zero_grad_after_forward
        ):
            micro = MicroStepCopy(session.recorder, params, policy)
            stack.enter_context(micro.watching())

        def mark(phase: Phase, iteration: int) -> None:
            session.recorder.set_phase(phase, iteration)
            session.modules.reset()

        run_steps(
            built,
            model,
            batch,
            optimizer,
            recipe,
            set_to_none=set_to_none,
            autocast=_forward_context(policy, recipe, session, model),
            mark_phase=copy.marking(mark) if copy else mark,
            backward=functools.partial(backward_in_place, recorder=session.recorder),
            **({"after_optimizer": copy.stepped, "skips_passes": copy.skips} if copy else {}),
            **({"copies_micro_step": micro.copies} if micro else {}),
        )
        if copy is not None:
            copy.write()
    return session.finish()


def fake_copy(batch: Any) -> Any:
    """Fake tensors with the shapes, strides and dtypes of ``batch``'s tensors (any device)."""
    return tree_map(
        lambda t: (
            torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu")
            if isinstance(t, torch.Tensor)
            else t
        ),
        batch,
    )


def trace_step_function(
    step_fn: Callable[[nn.Module, Any, Any], Any],
    model: nn.Module,
    batch: Any,
    make_optimizer: Callable[[list[nn.Parameter]], Any] | None,
    policy: DevicePolicy,
    recipe: Recipe,
    iterations: int = ITERATIONS,
    name: str = "step function",
) -> Trace:
    """Trace the user's own ``step_fn(model, batch, optimizer)``, called ``iterations`` times.

    ``model`` must be on the meta device; phases are found by themselves (backward while
    autograd runs, optimizer inside any ``optimizer.step()``), gradients from the
    parameters' hooks and optimizer state from every optimizer that stepped.
    """
    with (
        time_limit(f"step function {name}"),
        tracing(model, policy, recipe, name, "check the batch and the step function") as session,
    ):
        params = session.prepare_model(model)
        fake_batch = fake_copy(batch)
        session.tag_inputs(fake_batch)
        optimizer = make_optimizer(params) if make_optimizer is not None else None
        if optimizer is not None:
            _tag_optimizer_state(session.recorder, optimizer)
        for iteration in range(1, iterations + 1):
            session.recorder.set_phase(Phase.FORWARD, iteration)
            session.modules.reset()
            with policy.autocast(recipe):
                step_fn(model, fake_batch, optimizer)
    return session.finish()
