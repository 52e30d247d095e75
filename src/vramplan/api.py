"""Module-level conveniences, each a thin wrapper of ``Session`` (the answers without tracing
— ``calc``, ``layers``, ``llm``, ``gpus``, ``models`` — are in ``quick.py``)::

import vramplan
est = vramplan.estimate("torchvision:resnet50", batch_size=32, optimizer="sgd", gpu="t4")
est.components["gradients"] == est.model.parameter_bytes   # True
vramplan.max_batch_size("hf:gpt2", gpu="a10g", seq_len=1024).value
vramplan.plan("hf:meta-llama-3-8b", gpu="a100-80gb", batch_size=8, seq_len=4096)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vramplan.device.options import device_options
from vramplan.device.profile import DeviceProfile, save_profile
from vramplan.distributed.layout import ParallelLayout
from vramplan.distributed.options import layout_from_flags
from vramplan.errors import UserError
from vramplan.limits import DEFAULT_TIMEOUT, user_code_timeout
from vramplan.measurement.calibrate import calibrate_device
from vramplan.measurement.compare import Comparison
from vramplan.pipeline import estimate_user_step
from vramplan.planner.answer import PlanAnswer
from vramplan.planner.search import SearchResult
from vramplan.planner.serving import ServingPlan
from vramplan.recipe import Recipe
from vramplan.result import Estimate
from vramplan.session import Session
from vramplan.sources.user_code import leading_dim, meta_copy

SESSION_OPTIONS = tuple(inspect.signature(Session).parameters)[1:]
"""The keyword options of ``Session`` (everything after the model)."""


def _split(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Session options apart from recipe knobs."""
    session = {k: v for k, v in options.items() if k in SESSION_OPTIONS}
    return session, {k: v for k, v in options.items() if k not in SESSION_OPTIONS}


def estimate(
    model: str | nn.Module, *, layout: ParallelLayout | None = None, **options: Any
) -> Estimate:
    """Estimate one training (or inference) step of ``model``.

    ``model`` is a source name (``torchvision:resnet50``, ``hf:gpt2``, ``file.py:factory``)
    or an ``nn.Module``; for a module, ``example_batch`` (tensors of any device, only their
    shapes are used; it sets the batch size) and ``loss_fn(output, batch)`` describe the
    step. A tuple batch is ``(inputs, targets, ...)``: ``forward`` gets ``inputs`` (a tuple
    of inputs is spread over its arguments, a dict passed as keywords) and ``loss_fn`` the
    whole batch. Options are the
    ``Session``'s (``gpu``, ``gpu_memory``, ``headroom``, ``alloc_conf``,
    ``cudnn_benchmark``, ``profile``, ``target``) and the ``Recipe``'s knobs
    (``batch_size``, ``seq_len``, ``input_shape``, ``precision``, ``optimizer``,
    ``checkpointing``, ``grad_accum``, ``mode``; for named models also ``attention``,
    ``experts``, ``moe_routing``, ``target_len``, ``num_classes``).
    """
    session, knobs = _split(options)
    return Session(model, **session).estimate(layout=layout, **knobs)


def serve(model: str, *, gpu: str, **options: Any) -> ServingPlan:
    """What a serving engine (vLLM) reserves for ``model`` on ``gpu`` and the KV cache left:
    ``gpu_memory_utilization``, ``max_model_len``, ``tp``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``kv_cache_dtype``, ``block_size``, ``precision``."""
    session, knobs = _split(options)
    return Session(model, gpu=gpu, **session).serve(**knobs)


def max_batch_size(
    model: str | nn.Module, *, search: str = "batch_size", **options: Any
) -> SearchResult:
    """The largest batch (``search="seq_len"``: context) that fits ``gpu`` with headroom."""
    session, knobs = _split(options)
    return Session(model, **session).max_batch(search=search, **knobs)


def plan(
    model: str | nn.Module,
    *,
    host_memory: str | int | None = None,
    workers: int = 4,
    offload_optimizer: bool = False,
    **options: Any,
) -> PlanAnswer:
    """Levers, the first plan that fits, host RAM and the GPUs needed (see ``Session.plan``)."""
    session, knobs = _split(options)
    return Session(model, **session).plan(
        host_memory=host_memory, workers=workers, offload_optimizer=offload_optimizer, **knobs
    )


def measure(
    model: str,
    *,
    device: str | None = None,
    steps: int = 3,
    snapshot: str | None = None,
    **options: Any,
) -> Comparison:
    """Run the step for real and put the estimate beside the measurement."""
    session, knobs = _split(options)
    return Session(model, **session).measure(device=device, steps=steps, snapshot=snapshot, **knobs)


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
    timeout: float | None = DEFAULT_TIMEOUT,
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
    if target not in ("cuda", "cpu"):
        raise UserError(f"unknown target {target!r}; choose cuda or cpu")
    recipe = Recipe(
        batch_size=leading_dim(batch),
        precision=precision,
        optimizer="none",
        extras={
            "step_function": getattr(step_fn, "__name__", "step"),
            "optimizer": "user-defined" if optimizer is not None else "none",
        },
    )
    with user_code_timeout(timeout):
        return estimate_user_step(
            step_fn,
            meta_copy(model),
            batch,
            optimizer,
            recipe,
            iterations,
            name or f"{type(model).__name__} step",
            target,
            device_options(gpu, gpu_memory, headroom),
        )


def parallel_layout(**flags: Any) -> ParallelLayout:
    """A ParallelLayout from the command line's flags (``fsdp=8``, ``zero=3, dp=4``,
    ``tp=2, sp=True``, ``pp=4, microbatches=8``); one GPU when none is given."""
    return layout_from_flags(**flags)


def calibrate(output: str | Path | None = None) -> tuple[DeviceProfile, Path]:
    """Measure this machine's GPU runtime (needs CUDA) and save its device profile."""
    profile = calibrate_device()
    return profile, save_profile(profile, Path(output) if output else None)
