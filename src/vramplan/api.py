"""Module-level conveniences, each a thin wrapper of ``Session`` or of an analytic source::

import vramplan
est = vramplan.estimate("torchvision:resnet50", batch_size=32, optimizer="sgd", gpu="t4")
est.components["gradients"] == est.model.parameter_bytes   # True
vramplan.max_batch_size("hf:gpt2", gpu="a10g", seq_len=1024).value
vramplan.plan("hf:meta-llama-3-8b", gpu="a100-80gb", batch_size=8, seq_len=4096)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vramplan.analytic.calc import METHODS, calculate
from vramplan.analytic.layers import layers_estimate, load_spec
from vramplan.analytic.transformer import LoRA, Parallelism, transformer_estimate
from vramplan.device.catalog import GpuSpec, catalog
from vramplan.device.options import device_options
from vramplan.device.profile import DeviceProfile, save_profile
from vramplan.distributed.layout import ParallelLayout
from vramplan.distributed.options import layout_from_flags
from vramplan.errors import UserError
from vramplan.limits import DEFAULT_TIMEOUT, user_code_timeout
from vramplan.measure.calibrate import calibrate_device
from vramplan.measure.compare import Comparison
from vramplan.pipeline import estimate_user_step
from vramplan.plan.answer import PlanAnswer
from vramplan.plan.search import SearchResult
from vramplan.recipe import Recipe, parse_shape
from vramplan.result import Estimate
from vramplan.session import Session
from vramplan.sources import model_names
from vramplan.sources.hf import full_config, load_config_dict
from vramplan.sources.user_code import leading_dim, meta_copy
from vramplan.units import parse_count

SESSION_OPTIONS = (
    "gpu",
    "gpu_memory",
    "headroom",
    "alloc_conf",
    "cudnn_benchmark",
    "profile",
    "stack",
    "used_counter",
    "target",
    "framework",
    "example_batch",
    "loss_fn",
    "timeout",
)


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
    ``checkpointing``, ``grad_accum``, ``mode``).
    """
    session, knobs = _split(options)
    return Session(model, **session).estimate(layout=layout, **knobs)


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


def calc(
    params: str | int,
    *,
    activations_per_sample: str | int = 0,
    batch_size: int = 1,
    input_shape: str | tuple[int, ...] | None = None,
    precision: str = "fp32",
    optimizer: str = "adamw",
    mode: str = "train",
    method: str = "pytorch",
) -> Estimate:
    """The classic arithmetic (``vramplan calc``): ``params`` and activations per sample
    as numbers or with suffixes (``"20M"``, ``"1.3B"``)."""
    recipe = Recipe(batch_size=batch_size, precision=precision, optimizer=optimizer, mode=mode)
    return calculate(
        parse_count(params, "parameter count", minimum=1),
        batch_size,
        parse_count(activations_per_sample, "activations per sample"),
        recipe,
        _method(method),
        parse_shape(input_shape) if isinstance(input_shape, str) else input_shape,
    )


def layers(
    spec: str | Path,
    *,
    batch_size: int = 1,
    precision: str = "fp32",
    optimizer: str = "adamw",
    mode: str = "train",
    method: str = "pytorch",
) -> Estimate:
    """A table of layers from a YAML/JSON spec, shapes propagated (``vramplan layers``)."""
    recipe = Recipe(batch_size=batch_size, precision=precision, optimizer=optimizer, mode=mode)
    return layers_estimate(load_spec(str(spec)), recipe, _method(method), name=str(spec))


def llm(
    model: str,
    *,
    batch_size: int = 1,
    seq_len: int | None = None,
    precision: str | None = None,
    optimizer: str = "adamw",
    mode: str = "train",
    attention: str = "flash",
    recompute: str = "none",
    tp: int = 1,
    sp: bool = False,
    lora_rank: int = 0,
    qlora: bool = False,
) -> Estimate:
    """Transformer formulas from an ``hf:`` config, no model built (``vramplan llm``).
    ``precision`` defaults to ``amp-bf16``, how such models train (``estimate``'s default
    is ``fp32``); the answer's notes say so when it was not given."""
    if attention not in ("flash", "eager"):
        raise UserError(f"unknown attention {attention!r}; choose flash or eager")
    if recompute not in ("none", "selective", "full"):
        raise UserError(f"unknown recompute {recompute!r}; choose none, selective or full")
    if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 0:
        raise UserError(
            f"LoRA rank must be a positive integer (or 0 for full fine-tuning), got {lora_rank}"
        )
    if qlora and lora_rank == 0:
        raise UserError("--qlora needs --lora-rank R (a positive rank)")
    prefix, _, name = model.partition(":")
    if prefix != "hf" or not name:
        raise UserError(f"llm takes hf:NAME or hf:path/config.json, got {model!r}")
    label, config = load_config_dict(name)
    config = full_config(label, config)
    default_precision = precision is None
    precision = "amp-bf16" if default_precision else precision
    recipe = Recipe(
        batch_size=batch_size, seq_len=seq_len, precision=precision, optimizer=optimizer, mode=mode
    )
    estimate = transformer_estimate(
        config,
        recipe,
        f"hf:{label}",
        flash=attention == "flash",
        parallel=Parallelism(tp, sp),
        recompute=recompute,
        lora=LoRA(lora_rank, 4 if qlora else 16) if lora_rank else None,
    )
    if default_precision:
        note = "precision amp-bf16: llm's default (estimate's is fp32); --precision sets it"
        estimate = estimate.with_changes(notes=(note, *estimate.notes))
    return estimate


def _method(method: str) -> str:
    if method not in METHODS:
        raise UserError(f"unknown method {method!r}; choose pytorch or cs231n")
    return method


def gpus() -> tuple[GpuSpec, ...]:
    """The GPU catalog."""
    return catalog()


def models(source: str = "hf") -> list[str]:
    """The model names a source (``hf``, ``torchvision``, ``timm``) accepts."""
    return model_names(source)


def calibrate(output: str | Path | None = None) -> tuple[DeviceProfile, Path]:
    """Measure this machine's GPU runtime (needs CUDA) and save its device profile."""
    profile = calibrate_device()
    return profile, save_profile(profile, Path(output) if output else None)
