"""DeepSpeed's JSON config: ZeRO stage and offload, micro-batch, accumulation, the total
batch (which gives the GPU count), bf16/fp16, optimizer and activation checkpointing.

    >>> fields = Fields({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4,
    ...     "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 3}})
    >>> read_deepspeed(fields)
    64
    >>> fields.options
    {'zero': 3, 'batch_size': 4, 'grad_accum': 2, 'dp': 8}
"""

from __future__ import annotations

from vramplan.configs.fields import Fields
from vramplan.configs.names import class_optimizer
from vramplan.errors import UserError

MASTER_WEIGHTS = "DeepSpeed keeps fp32 master weights and optimizer state beside the half copy"


def _precision(fields: Fields, prefix: str = "") -> None:
    half = [
        kind
        for kind in ("bf16", "fp16")
        if fields.get(f"{prefix}{kind}.enabled") in (True, "true", "auto")
    ]
    if len(half) == 2 and "auto" not in (
        fields.peek(f"{prefix}bf16.enabled"),
        fields.peek(f"{prefix}fp16.enabled"),
    ):
        raise UserError("DeepSpeed config enables both bf16 and fp16; choose one")
    for kind in half:
        if fields.peek(f"{prefix}{kind}.enabled") == "auto":
            fields.note(f"{prefix}{kind}.enabled", "'auto' is set by the Trainer; give --precision")
            continue
        fields.honour(f"{prefix}{kind}.enabled", "precision", f"amp-{kind}", MASTER_WEIGHTS)
        return


def _optimizer(fields: Fields) -> None:
    kind = fields.get("optimizer.type")
    if kind is None:
        return
    optimizer, why = class_optimizer(kind)
    if optimizer == "sgd" and (fields.get("optimizer.params.momentum") or 0) > 0:
        optimizer = "momentum"
    if optimizer is None:
        fields.note("optimizer.type", f"{kind!r} is not modelled; counted as adamw")
        return
    fields.honour("optimizer.type", "optimizer", optimizer, why)


def _zero(fields: Fields) -> int:
    stage = fields.get("zero_optimization.stage", 0)
    if stage not in (0, 1, 2, 3):
        raise UserError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    if stage:
        fields.honour("zero_optimization.stage", "zero", stage)
    for part, option in (
        ("offload_optimizer", "offload_optimizer"),
        ("offload_param", "offload_params"),
    ):
        device = fields.get(f"zero_optimization.{part}.device", "none")
        if device in (None, "none"):
            continue
        if device not in ("cpu", "nvme"):
            raise UserError(
                f"zero_optimization.{part}.device must be none, cpu or nvme, got {device!r}"
            )
        if option == "offload_params" and stage != 3:
            raise UserError(
                f"zero_optimization.offload_param needs stage 3, the config has stage {stage}"
            )
        if not stage:
            raise UserError(f"zero_optimization.{part} needs ZeRO stage 1, 2 or 3")
        why = "NVMe counted as host memory" if device == "nvme" else ""
        fields.honour(f"zero_optimization.{part}.device", option, True, why)
    return stage


def _batch(fields: Fields, stage: int) -> int | None:
    micro = fields.number("train_micro_batch_size_per_gpu")
    accum = fields.number("gradient_accumulation_steps")
    total = fields.number("train_batch_size")
    if micro is not None:
        fields.honour("train_micro_batch_size_per_gpu", "batch_size", micro)
    if accum is not None:
        fields.honour("gradient_accumulation_steps", "grad_accum", accum)
    if total is None:
        if stage:
            fields.notes.append(
                "the GPU count is not in a DeepSpeed config: give --dp N (ZeRO shards over it)"
            )
        return None
    if micro is None:
        fields.note(
            "train_batch_size",
            "without train_micro_batch_size_per_gpu the per-GPU "
            "batch is unknown; give --batch-size",
        )
        return None
    per_gpu = micro * (accum or 1)
    if total % per_gpu:
        raise UserError(
            f"train_batch_size {total} is not a multiple of train_micro_batch_size_per_gpu "
            f"{micro} × gradient_accumulation_steps {accum or 1}"
        )
    fields.honour("train_batch_size", "dp", total // per_gpu, f"{total} / ({micro} × {accum or 1})")
    return total


def _checkpointing(fields: Fields) -> None:
    if not isinstance(fields.peek("activation_checkpointing"), dict):
        return
    fields.honour(
        "activation_checkpointing",
        "checkpointing",
        "full",
        "the model calls deepspeed.checkpointing; partitioned or CPU activations not modelled",
    )


def read_deepspeed(fields: Fields) -> int | None:
    """Fill ``fields.options`` from a DeepSpeed config; return ``train_batch_size``."""
    stage = _zero(fields)
    total = _batch(fields, stage)
    _precision(fields)
    _optimizer(fields)
    _checkpointing(fields)
    if fields.get("amp.enabled") is True:
        fields.honour("amp.enabled", "precision", "amp-fp16", "NVIDIA apex AMP")
    return total
