"""Run training (or inference) iterations under fake tensors and record them.

Two iterations by default: the optimizer state exists from the first ``step()``, and
the gradients of the second iteration coexist with it::

    >>> trace = trace_training(built, Recipe(batch_size=32), CudaPolicy())   # doctest: +SKIP
    >>> len(trace.allocations)                                              # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._pytree import tree_flatten

from vramplan.optimizers import build_optimizer, optimizer_state_tensors
from vramplan.sources.base import BuiltModel
from vramplan.trace.categorize import categorize
from vramplan.trace.errors import explain_failure
from vramplan.trace.events import Trace
from vramplan.trace.materialize import materialize, unique_parameters
from vramplan.trace.modules import ModuleStack
from vramplan.trace.policy import DevicePolicy, entered
from vramplan.trace.recorder import AllocationRecorder
from vramplan.workload import Recipe

ITERATIONS = 2
# Micro-steps traced per iteration under gradient accumulation: from the second one on,
# memory repeats (the gradients already exist), so tracing more changes nothing.
TRACED_MICRO_STEPS = 2


def _tag(recorder: AllocationRecorder, tensors, tag: str) -> None:
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            record = recorder.record_for(tensor)
            if record is not None:
                record.tags.add(tag)


@contextlib.contextmanager
def _optimizer_phase_hooks(recorder: AllocationRecorder):
    """Mark every ``optimizer.step()`` (the user's own too) as the optimizer phase."""
    pre = register_optimizer_step_pre_hook(
        lambda *a, **k: recorder.enter_optimizer()
    )
    post = register_optimizer_step_post_hook(
        lambda *a, **k: recorder.leave_optimizer()
    )
    try:
        yield
    finally:
        pre.remove()
        post.remove()


def _finish(recorder: AllocationRecorder, policy: DevicePolicy, notes: list[str],
            modules: ModuleStack) -> Trace:
    recorder.close()
    allocations = categorize(recorder.records, recorder.phases, recorder.event_count)
    if policy.step_scalars_on_host():
        host = {r.id for r in recorder.records if "host" in r.tags}
        allocations = tuple(a for a in allocations if a.id not in host)
    return Trace(
        allocations=allocations, phases=tuple(recorder.phases),
        event_count=recorder.event_count, notes=tuple(notes), module_kinds=dict(modules.kinds),
        op_counts=dict(recorder.op_counts),
    )


def _tag_optimizer_state(recorder: AllocationRecorder, optimizer) -> None:
    for tensor in optimizer_state_tensors(optimizer):
        record = recorder.record_for(tensor)
        if record is None:
            continue
        # A 0-dim ``step`` counter lives on the host on CUDA (not capturable, not fused).
        record.tags.add("host" if tensor.dim() == 0 else "optimizer_state")


def trace_training(built: BuiltModel, recipe: Recipe, policy: DevicePolicy) -> Trace:
    """Trace ``ITERATIONS`` steps of ``built`` with ``recipe`` under ``policy``."""
    notes: list[str] = []
    model = built.model
    param_dtype = getattr(torch, recipe.param_dtype_name)
    if param_dtype != torch.float32:
        model.to(param_dtype)
    if recipe.checkpointing == "full" and recipe.is_training:
        if built.enable_checkpointing is None:
            notes.append("checkpointing requested but this model has no blocks to checkpoint")
        else:
            built.enable_checkpointing(model)
    model.train(recipe.is_training)

    modules = ModuleStack()
    modules.name_modules(model)
    recorder = AllocationRecorder(modules)
    fake = FakeTensorMode()
    micro_steps = min(recipe.grad_accum, TRACED_MICRO_STEPS)
    if recipe.grad_accum > TRACED_MICRO_STEPS:
        notes.append(
            f"gradient accumulation {recipe.grad_accum}: traced {TRACED_MICRO_STEPS} micro-steps "
            "per iteration (memory repeats from the second on)"
        )
    try:
        with fake, recorder, modules, _optimizer_phase_hooks(recorder), entered(
            policy.dispatch_modes(recipe)
        ):
            materialize(model)
            params = unique_parameters(model)
            _tag(recorder, params, "parameters")
            _tag(recorder, model.buffers(), "buffers")
            batch = built.make_batch(recipe.batch_size, param_dtype)
            _tag(recorder, tree_flatten(batch)[0], "inputs")
            optimizer = None
            if recipe.is_training:
                for param in params:
                    if param.requires_grad:
                        param.register_post_accumulate_grad_hook(
                            lambda p: _tag(recorder, [p.grad], "gradients")
                        )
                optimizer = build_optimizer(recipe.optimizer, params, policy.optimizer_defaults())
                _tag_optimizer_state(recorder, optimizer)
            for iteration in range(1, ITERATIONS + 1):
                if recipe.is_training:
                    _train_iteration(built, model, batch, optimizer, recipe, policy, recorder,
                                     iteration, micro_steps)
                else:
                    recorder.set_phase("forward", iteration)
                    with torch.no_grad(), policy.autocast(recipe):
                        output = built.run(model, batch, False)
                    del output
                modules.reset()
    except Exception as exc:  # the user's model failed: say which op and what to do
        raise explain_failure(exc, built.name) from None
    return _finish(recorder, policy, notes + built.notes, modules)


def _train_iteration(built, model, batch, optimizer, recipe, policy, recorder, iteration,
                     micro_steps) -> None:
    for _ in range(micro_steps):
        recorder.set_phase("forward", iteration)
        with policy.autocast(recipe):
            loss = built.run(model, batch, True)
        if recipe.grad_accum > 1:
            loss = loss / recipe.grad_accum
        recorder.set_phase("backward", iteration)
        loss.backward()
        del loss
    recorder.set_phase("optimizer", iteration)
    if optimizer is not None:
        optimizer.step()
        _tag_optimizer_state(recorder, optimizer)
        optimizer.zero_grad(set_to_none=True)
    else:
        model.zero_grad(set_to_none=True)


def trace_step_function(
    step_fn: Callable[..., Any], args: tuple, policy: DevicePolicy, iterations: int = ITERATIONS,
    model: torch.nn.Module | None = None,
) -> Trace:
    """Trace the user's own step function, called ``iterations`` times with ``args``.

    Arguments must already be fake tensors or modules materialised under ``fake_mode()``;
    phases are found by themselves (backward while autograd runs, optimizer inside
    ``step()``), gradients and optimizer state from the tensors the model and optimizers hold.
    """
    raise NotImplementedError
