"""accelerate's config YAML (``accelerate config``): the distributed type, processes,
mixed precision, and its FSDP or DeepSpeed settings. The batch size lives in the script.

    >>> fields = Fields({"distributed_type": "FSDP", "num_processes": 8,
    ...     "mixed_precision": "bf16",
    ...     "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD"}})
    >>> read_accelerate(fields)
    >>> fields.options
    {'precision': 'amp-bf16', 'fsdp': 8, 'fsdp_version': 1}
"""

from __future__ import annotations

from vramplan.configs.fields import Fields
from vramplan.errors import UserError

TYPES = ("NO", "MULTI_GPU", "DEEPSPEED", "FSDP", "MEGATRON_LM", "MULTI_CPU", "XLA", "TPU")
_STRATEGIES = {
    "1": "full",
    "FULL_SHARD": "full",
    "2": "grad-op",
    "SHARD_GRAD_OP": "grad-op",
    "3": "none",
    "NO_SHARD": "none",
    "4": "full",
    "HYBRID_SHARD": "full",
    "5": "grad-op",
    "_HYBRID_SHARD_ZERO2": "grad-op",
}
_NOT_MODELLED = {
    "fsdp_config.fsdp_offload_params": "FSDP CPU offload of parameters is not modelled",
    "fsdp_config.fsdp_cpu_ram_efficient_loading": "affects loading, not the step",
    "deepspeed_config.deepspeed_config_file": "read that file with its own --config",
    "dynamo_config": "torch.compile is not modelled (the eager step is traced)",
}


def _precision(fields: Fields) -> None:
    mixed = str(fields.get("mixed_precision", "no")).lower()
    if mixed in ("bf16", "fp16"):
        fields.honour("mixed_precision", "precision", f"amp-{mixed}")
    elif mixed == "fp8":
        fields.note("mixed_precision", "fp8 (Transformer Engine / torchao) is not modelled")
    elif mixed not in ("no", "none"):
        raise UserError(f"mixed_precision must be no, fp16, bf16 or fp8, got {mixed!r}")


def _fsdp(fields: Fields, processes: int) -> None:
    strategy = str(fields.get("fsdp_config.fsdp_sharding_strategy", "FULL_SHARD")).upper()
    mode = _STRATEGIES.get(strategy)
    if mode is None:
        raise UserError(f"fsdp_config.fsdp_sharding_strategy {strategy!r} is not one FSDP knows")
    if strategy.startswith(("HYBRID", "4", "_HYBRID", "5")):
        fields.note(
            "fsdp_config.fsdp_sharding_strategy",
            f"{strategy}: sharded within one node only, counted over all processes",
        )
    reshard = fields.get("fsdp_config.fsdp_reshard_after_forward")
    if isinstance(reshard, str) and reshard.upper() in _STRATEGIES:  # FSDP1 spelling
        mode = _STRATEGIES[reshard.upper()]
        reshard = None
    if mode == "full" and reshard is not False:
        fields.honour("fsdp_config.fsdp_sharding_strategy", "fsdp", processes)
    else:
        fields.honour("fsdp_config.fsdp_sharding_strategy", "world_size", processes)
        fields.honour("fsdp_config.fsdp_sharding_strategy", "shard", mode)
    if mode != "none":
        _fsdp_version(fields)
    if fields.get("fsdp_config.fsdp_activation_checkpointing") is True:
        fields.honour("fsdp_config.fsdp_activation_checkpointing", "checkpointing", "full")


def _fsdp_version(fields: Fields) -> None:
    """``fsdp_config.fsdp_version``: 2 is FSDP2; 1, or none given, FSDP1, accelerate's
    default (1.15: ``accelerate launch --fsdp_version`` defaults to "1", exported as
    ``FSDP_VERSION``, and ``FullyShardedDataParallelPlugin`` reads ``FSDP_VERSION`` or "1")."""
    version = fields.get("fsdp_config.fsdp_version", 1)
    if str(version) not in ("1", "2"):
        raise UserError(f"fsdp_config.fsdp_version must be 1 or 2, got {version!r}")
    why = "" if fields.has("fsdp_config.fsdp_version") else "absent: accelerate's default"
    fields.honour("fsdp_config.fsdp_version", "fsdp_version", int(version), why)


def _deepspeed(fields: Fields, processes: int) -> None:
    stage = fields.get("deepspeed_config.zero_stage", 0)
    if stage not in (0, 1, 2, 3):
        raise UserError(f"deepspeed_config.zero_stage must be 0, 1, 2 or 3, got {stage!r}")
    if stage:
        fields.honour("deepspeed_config.zero_stage", "zero", stage)
    fields.honour("num_processes", "dp", processes)
    for part, option in (("optimizer", "offload_optimizer"), ("param", "offload_params")):
        device = fields.get(f"deepspeed_config.offload_{part}_device", "none")
        if device in ("none", None):
            continue
        if option == "offload_params" and stage != 3:
            raise UserError("deepspeed_config.offload_param_device needs zero_stage 3")
        if not stage:
            raise UserError(f"deepspeed_config.offload_{part}_device needs zero_stage 1, 2 or 3")
        fields.honour(f"deepspeed_config.offload_{part}_device", option, True)
    accum = fields.number("deepspeed_config.gradient_accumulation_steps")
    if accum is not None:
        fields.honour("deepspeed_config.gradient_accumulation_steps", "grad_accum", accum)


def read_accelerate(fields: Fields) -> None:
    """Fill ``fields.options`` from an accelerate config."""
    kind = str(fields.get("distributed_type", "NO")).upper()
    if kind not in TYPES:
        raise UserError(f"distributed_type {kind!r} is not one accelerate knows")
    processes = fields.number("num_processes") or 1
    _precision(fields)
    if kind == "FSDP":
        _fsdp(fields, processes)
    elif kind == "DEEPSPEED":
        _deepspeed(fields, processes)
    elif kind == "MULTI_GPU" and processes > 1:
        fields.honour("num_processes", "dp", processes, "DDP: a full replica on each GPU")
    elif kind in ("MEGATRON_LM", "XLA", "TPU", "MULTI_CPU"):
        fields.note("distributed_type", f"{kind} is not modelled; one GPU is estimated")
    if kind != "FSDP" and fields.has("fsdp_config"):
        fields.note("fsdp_config", f"distributed_type is {kind}, so accelerate does not use it")
    if kind != "DEEPSPEED" and fields.has("deepspeed_config"):
        fields.note(
            "deepspeed_config", f"distributed_type is {kind}, so accelerate does not use it"
        )
    for path, reason in _NOT_MODELLED.items():
        if fields.peek(path) not in (None, False, "none", "NO", "", {}):
            fields.note(path, reason)
    fields.notes.append("the batch size is set in your script: give --batch-size")
