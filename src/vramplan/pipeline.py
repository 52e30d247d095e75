"""The pipeline: a built model and a recipe → trace → summary → device model → Estimate.

Nothing else lives here: choosing the card, the layout and what to answer is the
Session's job (``session.py``)::

    built = resolve("torchvision:resnet18", recipe)
    est, trace = trace_and_estimate(built, recipe, "cuda", device_options(gpu="t4"))
    est.peak.allocated_bytes <= est.peak.reserved_bytes
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from vramplan.collector import quiet
from vramplan.device.options import DeviceOptions
from vramplan.device.replay import apply_device
from vramplan.errors import UserError
from vramplan.optimizers import MODELLED, implementation_note
from vramplan.recipe import Recipe
from vramplan.result import Component, Estimate, ModelInfo
from vramplan.sources import BuiltModel
from vramplan.sources.hf_attention import check_attention_target
from vramplan.sources.quantized import packed_numel_missing
from vramplan.trace.events import FLOPS_KEY, Trace
from vramplan.trace.generate import generation_details, trace_generation
from vramplan.trace.materialize import unique_parameters
from vramplan.trace.policy import DevicePolicy, policy_for
from vramplan.trace.repeat import repeat_built
from vramplan.trace.step import trace_step_function, trace_training
from vramplan.trace.summary import summarize_trace


def model_info(model: nn.Module, name: str, architecture: str, kind: str) -> ModelInfo:
    """Parameter and buffer counts of a (meta or fake) model; tied tensors counted once."""
    params = unique_parameters(model)
    buffers = {id(b): b for b in model.buffers()}.values()
    return ModelInfo(
        name=name,
        architecture=architecture,
        kind=kind,
        parameters=sum(p.numel() for p in params) + packed_numel_missing(model),
        trainable_parameters=sum(p.numel() for p in params if p.requires_grad),
        parameter_bytes=sum(p.numel() * p.element_size() for p in params),
        buffer_bytes=sum(b.numel() * b.element_size() for b in buffers),
    )


def estimate_built(
    built: BuiltModel,
    recipe: Recipe,
    target: str = "cuda",
    device: DeviceOptions | None = None,
    engine: Any = None,
) -> Estimate:
    """Trace a built model with a recipe, summarise the trace into an Estimate and, for the
    ``cuda`` target, replay it through the device model (allocator, runtime, verdict).
    ``engine`` (``distributed.fsdp.Fsdp2``) traces one rank of a sharded run."""
    return trace_and_estimate(built, recipe, target, device, engine=engine)[0]


def trace_and_estimate(
    built: BuiltModel,
    recipe: Recipe,
    target: str = "cuda",
    device: DeviceOptions | None = None,
    policy: DevicePolicy | None = None,
    engine: Any = None,
) -> tuple[Estimate, Trace]:
    """``estimate_built`` that also returns the trace (to judge it on other cards)."""
    device = device or DeviceOptions()
    policy = policy or _policy(target, device)
    check_attention_target(recipe.attention, policy.name, device.card.arch)
    trace = traced(built, recipe, policy, engine)
    return estimate_traced(built, recipe, trace, device, policy), trace


@quiet()  # pure Python over the trace: no storages, no collections
def estimate_traced(
    built: BuiltModel,
    recipe: Recipe,
    trace: Trace,
    device: DeviceOptions,
    policy: DevicePolicy,
    info: ModelInfo | None = None,
) -> Estimate:
    """The Estimate of ``trace`` (a step of ``built`` under ``recipe``, traced with
    ``policy``): summarised, and for the ``cuda`` policy replayed through the device
    model; what ``trace_and_estimate`` makes of the trace it takes. ``info``: the
    model's counts where ``built`` is not the model the trace ran (read off it else)."""
    notes = list(trace.notes)
    if recipe.is_training and recipe.optimizer in MODELLED:
        notes.append(f"optimizer {recipe.optimizer}: {MODELLED[recipe.optimizer]}")
    how = implementation_note(recipe.optimizer, recipe.optimizer_impl, policy.optimizer_defaults())
    if recipe.is_training and policy.name == "cuda" and how and built.make_optimizer is None:
        notes.append(how)  # torch.optim's step (a framework's own optimizer says its own)
    info = info or model_info(built.model, built.name, built.architecture, built.kind)
    result = estimate_from_trace(trace, info, recipe, policy.name, notes)
    if recipe.mode == "generate":
        details = {
            **result.details,
            "generation": generation_details(
                trace,
                recipe,
                built.generator.encoder_decoder,
                built.generator.image.tokens if built.generator.image else 0,
            ),
        }
        result = replace(result, details=details)
    if policy.name == "cuda":
        result = apply_device(result, trace, device)
    return result


def _cuda_rules(device: DeviceOptions) -> tuple:
    """``CudaPolicy``'s arguments for ``device``: its architecture, the emulated stack's
    rules and what its kernels' launches read (one list for every CUDA policy)."""
    software = device.software
    return (
        device.card.arch,
        software.foreach_default,
        software.zero_grad_frees,
        software.saves_every_operand,
        software.softmax_keeps_input,
        software.cudnn_dropout_steps,
        device.card.kernel_card,
        software.checkpoint_saves_empty,
    )


def _policy(target: str, device: DeviceOptions) -> DevicePolicy:
    """The trace policy for ``target`` as the emulated stack runs it."""
    return policy_for(target, *_cuda_rules(device))


def cuda_policy(device: DeviceOptions) -> DevicePolicy:
    """The CUDA trace policy of ``device`` (what ``trace_and_estimate`` traces with)."""
    return _policy("cuda", device)


def flop_counting_policy(device: DeviceOptions) -> DevicePolicy:
    """The CUDA policy of ``device`` that also counts the step's FLOPs (``trace/flops.py``):
    the same traced events, and the FLOPs in the trace's op counts (``FLOPS_KEY``)."""
    from vramplan.trace.flops import FlopCountingPolicy

    return FlopCountingPolicy(*_cuda_rules(device))


def traced(built: BuiltModel, recipe: Recipe, policy: DevicePolicy, engine: Any = None) -> Trace:
    """The trace of ``built``: its repeated blocks traced once and repeated where that is
    exact (also as one rank of a distributed ``engine``; not with ``built.repeat_blocks``
    off), else every block traced. Generation (``--mode generate``) is traced whole: one prefill and
    one decode step."""
    if recipe.mode == "generate":
        if engine is not None:
            raise UserError("--mode generate is traced on one GPU (no --fsdp)")
        return trace_generation(built, recipe, policy)
    if built.repeat_blocks:
        kind = (*policy.trace_key(), engine)
        trace, note = repeat_built(
            built, recipe, lambda b, r: _trace_counted(b, r, policy, engine), kind
        )
        if trace is not None:
            return replace(trace, notes=(*trace.notes, note), renumbered=True)
    else:
        note = ""
    trace = _trace_counted(built, recipe, policy, engine)
    return replace(trace, notes=(*trace.notes, note)) if note else trace


def _trace_counted(
    built: BuiltModel, recipe: Recipe, policy: DevicePolicy, engine: Any = None
) -> Trace:
    """``trace_training``; under a FLOP-counting policy (``policy.counter``, plan's
    recompute cost) the trace keeps its FLOPs in its op counts (``FLOPS_KEY``)."""
    trace = trace_training(built, recipe, policy, engine)
    counter = getattr(policy, "counter", None)
    if counter is None:
        return trace
    return replace(trace, op_counts={**trace.op_counts, FLOPS_KEY: counter.get_total_flops()})


def estimate_user_step(
    step_fn: Callable[[nn.Module, Any, Any], Any],
    meta_model: nn.Module,
    batch: Any,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None,
    recipe: Recipe,
    iterations: int,
    label: str,
    target: str,
    device: DeviceOptions,
) -> Estimate:
    """The user's own ``step_fn`` traced ``iterations`` times on a meta copy of their
    model, then (for ``cuda``) replayed through the device model."""
    policy = _policy(target, device)
    trace = trace_step_function(
        step_fn, meta_model, batch, optimizer, policy, recipe, iterations, label
    )
    info = model_info(meta_model, label, type(meta_model).__name__, "custom")
    result = estimate_from_trace(trace, info, recipe, policy.name, list(trace.notes))
    return apply_device(result, trace, device) if policy.name == "cuda" else result


def estimate_from_trace(
    trace: Trace, info: ModelInfo, recipe: Recipe, target: str, notes: list[str]
) -> Estimate:
    """Summarise a Trace into a tensor-level Estimate (no device model yet)."""
    summary = summarize_trace(trace, trace.module_kinds)
    return Estimate(
        model=info,
        recipe=recipe,
        peak=summary.peak,
        components=summary.components,
        method="trace",
        phase_peaks=summary.phase_peaks,
        top_modules=summary.top_modules,
        timeline=summary.timeline,
        notes=tuple(notes),
        details={
            "target": target,
            "traced_events": trace.event_count,
            "phase_components": summary.phase_components,
            "input_bytes": sum(
                a.nbytes for a in trace.allocations if a.category == Component.INPUTS
            ),
            **({"host_bytes": dict(trace.host_bytes)} if trace.host_bytes else {}),
            "optimizer_state_bytes": sum(
                a.nbytes
                for a in trace.allocations
                if a.category == Component.OPTIMIZER_STATE and a.free_index is None
            ),
        },
    )
