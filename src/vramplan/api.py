"""The Python API: ``estimate()`` for a named model or an ``nn.Module``.

    import vramplan
    est = vramplan.estimate("torchvision:resnet50", batch_size=32, optimizer="sgd")
    est.components["gradients"] == est.model.parameter_bytes   # True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from vramplan.calibrate import load_profile, profile_for
from vramplan.device import DeviceOptions, apply_device
from vramplan.errors import UserError
from vramplan.estimate import Estimate, ModelInfo
from vramplan.gpus import gpu_from_memory, lookup_gpu
from vramplan.optimizers import MODELLED
from vramplan.sources import BuiltModel, resolve
from vramplan.sources.user_code import meta_copy, module_source
from vramplan.summarize import summarize_trace
from vramplan.trace.events import Trace
from vramplan.trace.materialize import unique_parameters
from vramplan.trace.policy import DevicePolicy, policy_for
from vramplan.trace.step import trace_step_function, trace_training
from vramplan.workload import Recipe


def model_info(built: BuiltModel) -> ModelInfo:
    """Parameter counts of a built (meta or fake) model; tied weights counted once."""
    params = unique_parameters(built.model)
    buffers = {id(b): b for b in built.model.buffers()}.values()
    return ModelInfo(
        name=built.name,
        architecture=built.architecture,
        kind=built.kind,
        parameters=sum(p.numel() for p in params),
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
    policy = policy or policy_for(target, device.card.arch)
    trace = trace_training(built, recipe, policy, engine)
    notes = list(trace.notes)
    if recipe.is_training and recipe.optimizer in MODELLED:
        notes.append(f"optimizer {recipe.optimizer}: {MODELLED[recipe.optimizer]}")
    result = estimate_from_trace(trace, model_info(built), recipe, policy.name, notes)
    if policy.name == "cuda":
        result = apply_device(result, trace, device)
    return result, trace


def device_options(
    gpu: str | None = None,
    gpu_memory: str | None = None,
    headroom: float = 0.10,
    alloc_conf: str | None = None,
    cudnn_benchmark: bool = False,
    data_parallel: int = 1,
    profile: str | None = None,
) -> DeviceOptions:
    """Validated device options from names (``gpu="a100"`` or ``gpu_memory="24GiB"``); a
    profile path, or the saved profile of the named card, supplies measured runtime figures."""
    if gpu and gpu_memory:
        raise UserError("give either --gpu or --gpu-memory, not both")
    card = lookup_gpu(gpu) if gpu else gpu_from_memory(gpu_memory) if gpu_memory else None
    measured = load_profile(profile) if profile else profile_for(card.name) if gpu else None
    return DeviceOptions(
        gpu=card,
        headroom=headroom,
        alloc_conf=alloc_conf,
        cudnn_benchmark=cudnn_benchmark,
        data_parallel=data_parallel,
        profile=measured,
    )


def estimate_from_trace(
    trace, info: ModelInfo, recipe: Recipe, target: str, notes: list[str]
) -> Estimate:
    """Summarise a Trace into an Estimate."""
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
            "input_bytes": sum(a.nbytes for a in trace.allocations if a.category == "inputs"),
            "optimizer_state_bytes": sum(
                a.nbytes
                for a in trace.allocations
                if a.category == "optimizer_state" and a.free_index is None
            ),
        },
    )


def estimate(
    model: str | nn.Module,
    *,
    batch_size: int = 1,
    seq_len: int | None = None,
    input_shape: tuple[int, ...] | None = None,
    precision: str = "fp32",
    optimizer: str = "adamw",
    checkpointing: str = "none",
    grad_accum: int = 1,
    mode: str = "train",
    target: str = "cuda",
    example_batch: Any = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    gpu: str | None = None,
    gpu_memory: str | None = None,
    headroom: float = 0.10,
    alloc_conf: str | None = None,
    cudnn_benchmark: bool = False,
) -> Estimate:
    """Estimate one training (or inference) step of ``model``.

    ``model`` is a source name (``torchvision:resnet50``, ``hf:gpt2``, ``file.py:factory``)
    or an ``nn.Module``; for a module, ``example_batch`` (tensors of any device, only their
    shapes are used) and ``loss_fn(output, batch)`` describe the step. ``target="cpu"``
    traces what the CPU does instead of emulating a CUDA GPU. ``gpu`` (a catalog name) or
    ``gpu_memory`` ("24GiB") adds a verdict against that card after ``headroom``;
    ``alloc_conf`` takes ``PYTORCH_CUDA_ALLOC_CONF`` syntax.
    """
    device = device_options(gpu, gpu_memory, headroom, alloc_conf, cudnn_benchmark)
    recipe = Recipe(
        batch_size=batch_size,
        seq_len=seq_len,
        input_shape=input_shape,
        precision=precision,
        optimizer=optimizer,
        checkpointing=checkpointing,
        grad_accum=grad_accum,
        mode=mode,
    )
    if isinstance(model, nn.Module):
        built = module_source(model, recipe, type(model).__name__, example_batch, loss_fn)
    else:
        built = resolve(model, recipe)
    return estimate_built(built, recipe, target, device)


def estimate_step(
    step_fn: Callable[[nn.Module, Any, Any], Any],
    model: nn.Module,
    batch: Any,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
    *,
    iterations: int = 2,
    precision: str = "fp32",
    target: str = "cuda",
    name: str | None = None,
    gpu: str | None = None,
    gpu_memory: str | None = None,
    headroom: float = 0.10,
) -> Estimate:
    """Estimate the user's own training step: their loss, their loop, their optimizer.

    The trace runs on CPU tensors, where a ``torch.autocast("cuda")`` inside ``step_fn``
    does nothing: pass ``precision="amp-bf16"`` (or ``amp-fp16``) to run each call under
    the target GPU's autocast instead.

    ``step_fn(model, batch, optimizer)`` is called ``iterations`` times on fake copies:
    ``model`` may hold real weights (only its structure is copied), ``batch`` holds tensors
    whose shapes are used, and ``optimizer`` builds the optimizer from the parameters::

        def step(model, batch, opt):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward(); opt.step(); opt.zero_grad()

        est = estimate_step(step, net, (images, labels), lambda p: torch.optim.AdamW(p))
    """
    if not isinstance(model, nn.Module):
        raise UserError(f"estimate_step needs an nn.Module, got {type(model).__name__}")
    if not isinstance(iterations, int) or iterations <= 0:
        raise UserError(f"iterations must be a positive integer, got {iterations}")
    label = name or f"{type(model).__name__} step"
    meta_model = meta_copy(model)
    batch_size = _leading_dim(batch)
    recipe = Recipe(
        batch_size=batch_size,
        precision=precision,
        optimizer="none",
        extras={
            "step_function": getattr(step_fn, "__name__", "step"),
            "optimizer": "user-defined" if optimizer is not None else "none",
        },
    )
    policy = policy_for(target)
    trace = trace_step_function(
        step_fn, meta_model, batch, optimizer, policy, recipe, iterations, label
    )
    device = device_options(gpu, gpu_memory, headroom)
    params = list({id(p): p for p in meta_model.parameters()}.values())
    info = ModelInfo(
        name=label,
        architecture=type(model).__name__,
        kind="custom",
        parameters=sum(p.numel() for p in params),
        trainable_parameters=sum(p.numel() for p in params if p.requires_grad),
        parameter_bytes=sum(p.numel() * p.element_size() for p in params),
        buffer_bytes=sum(b.numel() * b.element_size() for b in meta_model.buffers()),
    )
    result = estimate_from_trace(trace, info, recipe, policy.name, list(trace.notes))
    return apply_device(result, trace, device) if policy.name == "cuda" else result


def _leading_dim(batch: Any) -> int:
    """The batch size: the first dimension of the batch's first tensor."""
    from torch.utils._pytree import tree_flatten

    for leaf in tree_flatten(batch)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return 1
