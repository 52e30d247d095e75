"""Hugging Face Trainer: estimate a ``Trainer`` (or a model + ``TrainingArguments``) as it
will run, and pick the largest ``per_device_train_batch_size`` that fits a card before
training starts, with no OOM trial::

    from vramplan.integrations.transformers import estimate_trainer, fit_batch_size

    trainer = Trainer(model=model, args=args, train_dataset=train)
    estimate_trainer(trainer, seq_len=1024, gpu="a10g").verdict.status   # 'fits'...
    fit_batch_size(trainer, seq_len=1024, gpu="a10g")   # sets the largest safe batch
    trainer.train()

The model is traced as it is (a meta-device copy: its weights are never touched), with
the Trainer's batch, accumulation, bf16/fp16 autocast, gradient checkpointing, ``optim``
and DeepSpeed / FSDP settings; ``seq_len`` is the longest sample your collator makes.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from torch import nn

from vramplan.configs import TrainingConfig
from vramplan.configs.training_args import read_training_args
from vramplan.errors import UserError
from vramplan.planner.search import SearchResult
from vramplan.result import Estimate
from vramplan.session import Session

DEVICE_OPTIONS = ("gpu", "gpu_memory", "headroom", "alloc_conf", "profile", "stack", "timeout")


def training_args_config(args: Any, seq_len: int | None = None) -> TrainingConfig:
    """What ``args`` (a ``TrainingArguments``, or trl's ``SFTConfig``) asks of the step."""
    if not hasattr(args, "to_dict") or not hasattr(args, "per_device_train_batch_size"):
        raise UserError(f"expected transformers' TrainingArguments, got {type(args).__name__}")
    config = read_training_args(
        args.to_dict(),
        _defaults(args),
        world_size=max(1, args.world_size),
        transformers_version=_transformers_version(args),
    )
    if seq_len is not None:
        config = config.with_flags(seq_len=seq_len)
    if "seq_len" not in config.options:
        raise UserError(
            "give seq_len=: the longest sample your data collator makes (TrainingArguments "
            "do not say)"
        )
    return config


def _transformers_version(args: Any) -> str | None:
    """The version of the transformers that will run ``args`` (a ``TrainingArguments`` or
    trl's subclass of it), or None for arguments of another kind."""
    if not type(args).__module__.startswith(("transformers.", "trl.")):
        return None
    return getattr(sys.modules.get("transformers"), "__version__", None)


def _defaults(args: Any) -> dict[str, Any]:
    """The dataclass defaults of ``args``' fields (no TrainingArguments is built: building
    one resets accelerate's state in the user's process)."""
    found = {}
    for spec in dataclasses.fields(args) if dataclasses.is_dataclass(args) else ():
        if spec.default is not dataclasses.MISSING:
            found[spec.name] = spec.default
        elif spec.default_factory is not dataclasses.MISSING:
            found[spec.name] = spec.default_factory()
    return found


def _traced(model: nn.Module) -> nn.Module:
    """The module to trace: a peft model's base model, which holds its adapters."""
    if not isinstance(model, nn.Module):
        raise UserError(f"expected an nn.Module, got {type(model).__name__}")
    base = getattr(model, "get_base_model", None)
    return base() if callable(base) and isinstance(base(), nn.Module) else model


def _session(model: nn.Module, options: dict[str, Any]) -> Session:
    unknown = sorted(set(options) - set(DEVICE_OPTIONS))
    if unknown:
        raise UserError(f"unknown option {unknown[0]!r}; choose from {', '.join(DEVICE_OPTIONS)}")
    return Session(_traced(model), **options)


def estimate_training_args(
    model: nn.Module, args: Any, *, seq_len: int | None = None, **device: Any
) -> Estimate:
    """One training step of ``model`` as the Trainer would run it with ``args``, per GPU;
    ``device``: ``gpu``, ``gpu_memory``, ``headroom``... as ``vramplan.Session`` takes."""
    config = training_args_config(args, seq_len)
    result = _session(model, device).estimate(config.recipe(), layout=config.layout())
    return result.with_changes(notes=(*config.lines(), *result.notes))


def estimate_trainer(trainer: Any, *, seq_len: int | None = None, **device: Any) -> Estimate:
    """``estimate_training_args(trainer.model, trainer.args, ...)``."""
    return estimate_training_args(trainer.model, trainer.args, seq_len=seq_len, **device)


def estimate_evaluation(
    model: nn.Module, args: Any, *, seq_len: int | None = None, **device: Any
) -> Estimate:
    """The evaluation step (no grad) at ``per_device_eval_batch_size``, under the same
    autocast (or in pure bf16/fp16 with ``bf16_full_eval`` / ``fp16_full_eval``)."""
    config = training_args_config(args, seq_len)
    recipe = config.recipe()
    precision = recipe.precision
    if getattr(args, "bf16_full_eval", False) or getattr(args, "fp16_full_eval", False):
        precision = "bf16" if args.bf16_full_eval else "fp16"
    recipe = recipe.with_changes(
        mode="infer",
        batch_size=args.per_device_eval_batch_size,
        precision=precision,
        checkpointing="none",
        grad_accum=1,
    )
    return _session(model, device).estimate(recipe)


def largest_batch(
    model: nn.Module, args: Any, *, seq_len: int | None = None, **device: Any
) -> SearchResult:
    """The largest ``per_device_train_batch_size`` that fits each GPU with the headroom
    kept free, confirmed by tracing N (fits) and N + 1 (does not); under the FSDP, ZeRO or
    DDP layout ``args`` name, one rank's step, as ``estimate_training_args`` judges it."""
    if device.get("gpu") is None and device.get("gpu_memory") is None:
        raise UserError("give the card: gpu='a10g' (or gpu_memory='24GiB')")
    config = training_args_config(args, seq_len).with_flags(batch_size=1)
    return _session(model, device).max_batch(config.recipe(), layout=config.layout())


def safe_batch_size(
    model: nn.Module, args: Any, *, seq_len: int | None = None, **device: Any
) -> int:
    """The largest safe ``per_device_train_batch_size`` (see ``largest_batch``)."""
    return largest_batch(model, args, seq_len=seq_len, **device).value


def fit_batch_size(trainer: Any, *, seq_len: int | None = None, **device: Any) -> SearchResult:
    """Set ``trainer``'s per-device batch to the largest that fits, before ``train()``.

    The Trainer reads its batch size once, when it is built (``_train_batch_size``, which
    its own ``auto_find_batch_size`` also rewrites), so the value is set there and in
    ``trainer.args``."""
    answer = largest_batch(trainer.model, trainer.args, seq_len=seq_len, **device)
    trainer.args.per_device_train_batch_size = answer.value
    trainer._train_batch_size = trainer.args.train_batch_size
    return answer
