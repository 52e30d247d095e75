"""torchtitan's TOML: model name and flavour, local batch and sequence length, FSDP /
tensor / pipeline degrees, mixed precision, and its activation checkpointing — full,
selective per layer (every N blocks) or selective per op (its save list). Fields a file
leaves out take torchtitan's defaults, which are listed as such.

    >>> fields = Fields({"model": {"name": "llama3", "flavor": "8B"},
    ...     "training": {"local_batch_size": 2, "seq_len": 8192},
    ...     "parallelism": {"data_parallel_shard_degree": 8},
    ...     "activation_checkpoint": {"mode": "selective", "selective_ac_option": "op"}})
    >>> read_torchtitan(fields)
    'hf:meta-llama-3-8b'
    >>> fields.options["fsdp"], fields.options["checkpointing"]
    (8, 'op')
"""

from __future__ import annotations

from vramplan.configs.fields import Fields
from vramplan.configs.names import class_optimizer
from vramplan.errors import UserError

FLAVOURS = {
    ("llama3", "8b"): "meta-llama-3-8b",
    ("llama3", "70b"): "meta-llama-3-70b",
    ("llama2", "7b"): "llama-2-7b",
    ("llama2", "13b"): "llama-2-13b",
}
DEFAULTS = {"batch_size": 8, "seq_len": 2048}
"""torchtitan's JobConfig defaults for ``training.local_batch_size`` and ``seq_len``."""
_NOT_MODELLED = {
    "parallelism.context_parallel_degree": "context parallelism is not modelled",
    "parallelism.data_parallel_replicate_degree": "HSDP replicas hold the same shards; "
    "counted by the shard degree alone",
    "parallelism.enable_async_tensor_parallel": "async TP is not modelled",
    "training.compile": "torch.compile is not modelled (the eager step is traced)",
    "compile.enable": "torch.compile is not modelled (the eager step is traced)",
    "float8.enable_fsdp_float8_all_gather": "float8 all-gather is not modelled",
    "model.converters": "float8 / MX converters are not modelled",
    "training.enable_cpu_offload": "FSDP CPU offload is not modelled",
}


def _model(fields: Fields) -> str | None:
    name, flavour = fields.get("model.name"), fields.get("model.flavor")
    bundled = FLAVOURS.get((str(name).lower(), str(flavour).lower()))
    if bundled is None:
        if name is not None:
            fields.notes.append(
                f"model {name} {flavour} has no bundled config here: give the model on the "
                "command line (hf:path/config.json)"
            )
        return None
    fields.honoured.append(f"model.name + model.flavor → hf:{bundled}")
    return f"hf:{bundled}"


def _field(fields: Fields, *paths: str) -> tuple[str, int | None]:
    """The first of ``paths`` present (old and new torchtitan spell some differently)."""
    for path in paths:
        if fields.has(path):
            return path, fields.number(path, minimum=-1)
    return paths[0], None


def _batch(fields: Fields) -> None:
    for option, paths in (
        ("batch_size", ("training.local_batch_size", "training.batch_size")),
        ("seq_len", ("training.seq_len",)),
    ):
        path, value = _field(fields, *paths)
        if value is None:
            value = DEFAULTS[option]
            fields.honoured.append(
                f"{path} (torchtitan's default) → --{option.replace('_', '-')} {value}"
            )
            fields.options[option] = value
        else:
            fields.honour(path, option, value)


def _parallelism(fields: Fields) -> None:
    path, shard = _field(
        fields, "parallelism.data_parallel_shard_degree", "training.data_parallel_shard_degree"
    )
    if shard == -1 or shard is None:
        fields.notes.append(
            f"{path} = -1 takes every GPU left, and the GPU count is not in the file: give --fsdp N"
        )
    elif shard > 1:
        fields.honour(path, "fsdp", shard)
        reshard = str(fields.get("parallelism.fsdp_reshard_after_forward", "default")).lower()
        if reshard == "never":
            fields.honour("parallelism.fsdp_reshard_after_forward", "reshard_after_forward", False)
    path, tp = _field(
        fields, "parallelism.tensor_parallel_degree", "training.tensor_parallel_degree"
    )
    if tp and tp > 1:
        fields.honour(path, "tp", tp)
    path, pp = _field(
        fields, "parallelism.pipeline_parallel_degree", "experimental.pipeline_parallel_degree"
    )
    if pp and pp > 1:
        fields.honour(path, "pp", pp)


def _checkpointing(fields: Fields) -> None:
    mode = str(fields.get("activation_checkpoint.mode", "selective")).lower()
    default = "" if fields.has("activation_checkpoint.mode") else " (torchtitan's default)"
    if mode == "none":
        return
    if mode == "full":
        fields.honour("activation_checkpoint.mode", "checkpointing", "full")
        return
    if mode != "selective":
        fields.note("activation_checkpoint.mode", f"{mode!r} is not modelled; none assumed")
        return
    option = str(fields.get("activation_checkpoint.selective_ac_option", "2")).lower()
    if option == "op":
        value, why = "op", "saves the outputs of torchtitan's op list, recomputes the rest"
    elif option.isdigit() and int(option) > 0:
        value, why = f"every:{int(option)}", f"every {int(option)}th block recomputed"
    else:
        raise UserError(
            f"activation_checkpoint.selective_ac_option must be 'op' or a positive block "
            f"count, got {option!r}"
        )
    fields.honour(
        "activation_checkpoint.selective_ac_option", "checkpointing", value, why + default
    )


def read_torchtitan(fields: Fields) -> str | None:
    """Fill ``fields.options`` from a torchtitan config; return the model it names."""
    model = _model(fields)
    _batch(fields)
    _parallelism(fields)
    _checkpointing(fields)
    mixed = str(fields.get("training.mixed_precision_param", "bfloat16")).lower()
    if mixed in ("bfloat16", "float16"):
        half = "bf16" if mixed == "bfloat16" else "fp16"
        default = "" if fields.has("training.mixed_precision_param") else " (torchtitan's default)"
        fields.options["precision"] = f"amp-{half}"
        fields.honoured.append(f"training.mixed_precision_param{default} → --precision amp-{half}")
    elif mixed != "float32":
        raise UserError(
            f"training.mixed_precision_param must be bfloat16, float16 or float32, got {mixed!r}"
        )
    name = fields.get("optimizer.name")
    if name is not None:
        optimizer, why = class_optimizer(name)
        if optimizer is None:
            fields.note("optimizer.name", f"{name!r} is not modelled; counted as adamw")
        else:
            fields.honour("optimizer.name", "optimizer", optimizer, why)
    for path, reason in _NOT_MODELLED.items():
        value = fields.peek(path)
        unset = value in (None, False, [], "") or (type(value) is int and value == 1)
        if not unset:
            fields.note(path, reason)
    return model
