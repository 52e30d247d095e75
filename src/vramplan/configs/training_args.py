"""Hugging Face ``TrainingArguments`` (as ``args.to_dict()``) read like a config file: the
per-device batch, accumulation, bf16/fp16, gradient checkpointing, ``optim``, and the
DeepSpeed or FSDP settings. Fields left at transformers' defaults are not listed; the
others are honoured, noted or named as ignored.

    >>> config = read_training_args({"per_device_train_batch_size": 4, "bf16": True,
    ...     "optim": "adamw_bnb_8bit", "gradient_checkpointing": True, "seed": 7},
    ...     defaults={"seed": 42})
    >>> config.recipe().precision, config.recipe().optimizer, config.ignored
    ('amp-bf16', 'adam8bit', ('seed',))
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vramplan.configs.config import TrainingConfig
from vramplan.configs.deepspeed import read_deepspeed
from vramplan.configs.fields import Fields
from vramplan.configs.files import load_mapping
from vramplan.configs.names import hf_optimizer
from vramplan.errors import UserError

READ = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "bf16",
    "fp16",
    "gradient_checkpointing",
    "activation_checkpointing",
    "optim",
)
_NOT_MODELLED = {
    "per_device_eval_batch_size": "evaluation is a separate no-grad step: "
    "vramplan.integrations.transformers.estimate_evaluation estimates it",
    "auto_find_batch_size": "vramplan picks the batch before launch instead: "
    "vramplan.integrations.transformers.fit_batch_size",
    "optim_target_modules": "GaLore-style projections are not modelled",
}
SEQ_LEN_FIELDS = ("max_length", "max_seq_length")
"""trl's ``SFTConfig`` (a TrainingArguments) names the sequence length."""


def _deepspeed(value: Any, fields: Fields) -> TrainingConfig | None:
    if not value:
        return None
    data = value if isinstance(value, dict) else load_mapping(Path(value))
    ds = Fields(data)
    total = read_deepspeed(ds)
    fields.get("deepspeed")
    return TrainingConfig(
        "deepspeed",
        "DeepSpeed",
        None,
        dict(ds.options),
        tuple(f"deepspeed.{h}" for h in ds.honoured),
        tuple(f"deepspeed.{n}" for n in ds.notes),
        tuple(f"deepspeed.{i}" for i in ds.ignored()),
        global_batch=total,
    )


def _compile(fields: Fields, autocast: bool) -> None:
    """``torch_compile``: the Trainer compiles the whole model (``torch.compile(model)``);
    traced as each repeated block compiled (``--compile``), the model's own loss eager."""
    if not fields.get("torch_compile"):
        return
    if autocast:
        fields.note(
            "torch_compile",
            "torch.compile under the Trainer's autocast is not modelled (the eager step is traced)",
        )
        return
    fields.honour(
        "torch_compile", "compile", True, "each repeated block as AOTAutograd's partition runs it"
    )


def _reentrant(fields: Fields, path: str) -> None:
    """``use_reentrant`` in the checkpointing kwargs: True is ``--reentrant``. Unset is the
    reading transformers' default, non-reentrant in 5 (``{"use_reentrant": False}``);
    transformers 4.x's ``gradient_checkpointing_enable`` defaulted to reentrant."""
    for kwargs in (f"{path}_kwargs", "gradient_checkpointing_kwargs"):
        key = f"{kwargs}.use_reentrant"
        if fields.has(key):
            if fields.get(key) is True:
                fields.honour(key, "reentrant", True, "reentrant torch.utils.checkpoint")
            return
    if fields.peek("fsdp"):  # what FSDP1 holds depends on it
        fields.notes.append(
            f"{path}: non-reentrant, transformers 5's default (4.x checkpointed reentrantly "
            "without gradient_checkpointing_kwargs: give --reentrant for it)"
        )


def _fsdp_version(fields: Fields, transformers_version: str | None) -> None:
    """Which FSDP the Trainer runs. transformers 5 reads ``fsdp_config.version``, 2 when
    unset (``TrainingArguments._process_fsdp_args``: ``int(self.fsdp_config.get("version",
    2))``, 5.24). transformers 4.x never reads it (4.57.1's ``__post_init__`` exports the
    other ``fsdp_config`` keys as ``FSDP_*`` variables, not a version): accelerate's
    ``FullyShardedDataParallelPlugin`` takes ``FSDP_VERSION`` from ``accelerate launch``,
    "1" when unset (1.15), so FSDP1 unless the launch says otherwise. A dump from
    ``to_dict()`` does not say which transformers wrote it: unknown keeps version 2 (or
    the one set) and says so."""
    path = "fsdp_config.version"
    version = fields.get(path)
    if version is not None and str(version) not in ("1", "2"):
        raise UserError(f"fsdp_config.version must be 1 or 2, got {version!r}")
    major = None if transformers_version is None else int(transformers_version.split(".")[0])
    if major is not None and major < 5:
        why = (
            f"transformers {transformers_version} reads no version: accelerate's "
            "FSDP_VERSION, 1 unless the launch sets it"
        )
        fields.honour(path, "fsdp_version", 1, why)
        return
    if version is not None:
        fields.honour(path, "fsdp_version", int(version))
    elif major is None:
        fields.notes.append(
            f"{path}: unset, FSDP2 as transformers 5 runs it; the dump does not say which "
            "transformers wrote it, and 4.x ran FSDP1 (accelerate's default): give "
            "--fsdp-version 1 for it"
        )


def _fsdp(fields: Fields, world_size: int, transformers_version: str | None) -> None:
    value = fields.get("fsdp")
    if not value:
        return
    modes = value.split() if isinstance(value, str) else list(value) if value is not True else []
    modes = [str(m).lower() for m in modes]
    if "offload" in modes:
        fields.notes.append("fsdp offload: FSDP CPU offload is not modelled")
    reshard = fields.get("fsdp_config.reshard_after_forward", True)
    if "shard_grad_op" in modes or reshard is False:
        fields.honour("fsdp", "world_size", world_size, "FSDP over the processes")
        fields.honour("fsdp", "shard", "grad-op")
    else:
        fields.honour("fsdp", "fsdp", world_size, "FSDP over the processes")
    _fsdp_version(fields, transformers_version)
    if fields.get("fsdp_config.activation_checkpointing") is True:
        fields.honour("fsdp_config.activation_checkpointing", "checkpointing", "full")


def read_training_args(
    values: dict[str, Any],
    defaults: dict[str, Any] | None = None,
    world_size: int = 1,
    transformers_version: str | None = None,
) -> TrainingConfig:
    """The TrainingConfig of ``TrainingArguments.to_dict()`` (``defaults``: the same of
    default arguments, whose unchanged fields are left out; ``world_size``: processes;
    ``transformers_version``: the transformers that runs them, None when not known)."""
    defaults = defaults or {}
    data = {k: v for k, v in values.items() if k in READ or k not in defaults or defaults[k] != v}
    fields = Fields(data)
    fields.honour(
        "per_device_train_batch_size", "batch_size", values.get("per_device_train_batch_size", 8)
    )
    accum = fields.number("gradient_accumulation_steps") or 1
    fields.honour("gradient_accumulation_steps", "grad_accum", accum)
    bf16, fp16 = fields.get("bf16"), fields.get("fp16")
    if bf16 and fp16:
        raise UserError("TrainingArguments: bf16 and fp16 are both set; choose one")
    if bf16 or fp16:
        kind = "bf16" if bf16 else "fp16"
        fields.honour(kind, "precision", f"amp-{kind}", "the Trainer's autocast")
    for path in ("activation_checkpointing", "gradient_checkpointing"):  # transformers 5, 4
        if fields.get(path):
            fields.honour(path, "checkpointing", "full")
            fields.get("gradient_checkpointing")
            _reentrant(fields, path)
            break
    name = fields.get("optim", "adamw_torch")
    optimizer, why = hf_optimizer(getattr(name, "value", name))
    if optimizer is None:
        fields.note("optim", f"{name!r} is not modelled; counted as adamw")
    else:
        fields.honour("optim", "optimizer", optimizer, why)
    for path in SEQ_LEN_FIELDS:
        length = fields.number(path)
        if length is not None:
            fields.honour(path, "seq_len", length)
            break
    _compile(fields, autocast=bool(bf16 or fp16))
    _fsdp(fields, world_size, transformers_version)
    ds = _deepspeed(values.get("deepspeed"), fields)
    for path, reason in _NOT_MODELLED.items():
        if fields.has(path) and fields.peek(path) not in (None, False, [], ""):
            fields.note(path, reason)
    options = dict(fields.options)
    honoured, notes, ignored, total = list(fields.honoured), list(fields.notes), [], None
    if ds is not None:
        options = {**ds.options, **options}  # the Trainer fills DeepSpeed's "auto" from args
        if ds.options.get("zero") and "dp" not in ds.options:
            options["dp"] = world_size
        honoured += ds.honoured
        notes += ds.notes
        ignored += ds.ignored
        total = ds.global_batch
    elif world_size > 1 and not any(k in options for k in ("fsdp", "world_size")):
        options["dp"] = world_size
        honoured.append(f"world_size → --dp {world_size} (DDP)")
    return TrainingConfig(
        "TrainingArguments",
        "transformers",
        None,
        options,
        tuple(honoured),
        tuple(notes),
        tuple(fields.ignored() + ignored),
        global_batch=total,
    )
