"""axolotl's YAML: base model, LoRA / QLoRA adapter, 4- or 8-bit loading, micro-batch,
accumulation, ``sequence_len``, gradient checkpointing, optimizer, bf16/fp16.

    >>> fields = Fields({"base_model": "meta-llama/Meta-Llama-3-8B", "adapter": "qlora",
    ...     "load_in_4bit": True, "lora_r": 16, "micro_batch_size": 2})
    >>> read_axolotl(fields)
    'hf:meta-llama/Meta-Llama-3-8B'
    >>> fields.options["quantize"], fields.options["lora"]
    ('nf4', 16)
"""

from __future__ import annotations

from vramplan.configs.fields import Fields
from vramplan.configs.names import hf_optimizer
from vramplan.errors import UserError

_NOT_MODELLED = {
    "deepspeed": "the DeepSpeed JSON it names is read with its own --config",
    "fsdp": "FSDP from axolotl's config is not read: give --fsdp N",
    "fsdp_config": "FSDP from axolotl's config is not read: give --fsdp N",
    "sample_packing": "packing fills each sample to sequence_len, as estimated",
    "torch_compile": "torch.compile is not modelled (the eager step is traced)",
    "eval_batch_size": "evaluation is a separate no-grad step, not estimated here",
    "gpu_memory_limit": "a loading limit, not the step",
    "lora_modules_to_save": "modules trained in full beside LoRA are not modelled",
    "peft_use_dora": "DoRA's magnitude vectors are not modelled (counted as LoRA)",
    "unsloth_lora_mlp": "Unsloth kernels are not modelled",
    "liger_fused_linear_cross_entropy": "Liger's fused loss is not modelled",
}


def _adapter(fields: Fields) -> None:
    adapter = fields.get("adapter")
    four, eight = fields.get("load_in_4bit") is True, fields.get("load_in_8bit") is True
    if four and eight:
        raise UserError("load_in_4bit and load_in_8bit are both set; choose one")
    if adapter == "qlora" and not four:
        raise UserError("adapter: qlora needs load_in_4bit: true")
    if four:
        fields.honour("load_in_4bit", "quantize", "nf4")
        fields.honour("load_in_4bit", "double_quant", True, "axolotl's bnb_4bit_use_double_quant")
    elif eight:
        fields.honour("load_in_8bit", "quantize", "int8")
    if adapter in (None, ""):
        if any(fields.has(k) for k in ("lora_r", "lora_target_modules", "lora_target_linear")):
            fields.notes.append("lora_* fields without adapter: lora/qlora: trained in full")
        return
    if adapter not in ("lora", "qlora"):
        raise UserError(f"adapter must be lora or qlora, got {adapter!r}")
    rank = fields.number("lora_r")
    if rank is None:
        raise UserError(f"adapter: {adapter} needs lora_r")
    fields.honour("lora_r", "lora", rank)
    alpha = fields.get("lora_alpha")
    if alpha is not None:
        fields.honour("lora_alpha", "lora_alpha", float(alpha))
    dropout = fields.get("lora_dropout")
    if dropout:
        fields.honour("lora_dropout", "lora_dropout", float(dropout))
    if fields.get("lora_target_linear") is True:
        fields.honour("lora_target_linear", "lora_targets", "all-linear")
    else:
        targets = fields.get("lora_target_modules")
        if targets:
            fields.honour("lora_target_modules", "lora_targets", ",".join(map(str, targets)))


def _precision(fields: Fields) -> None:
    bf16, fp16 = fields.get("bf16"), fields.get("fp16")
    if bf16 in (True, "auto") and fp16 is True:
        raise UserError("bf16 and fp16 are both set; choose one")
    if bf16 in (True, "auto"):
        fields.honour("bf16", "precision", "amp-bf16", "the Trainer's autocast")
    elif fp16 is True:
        fields.honour("fp16", "precision", "amp-fp16", "the Trainer's autocast")


def read_axolotl(fields: Fields) -> str | None:
    """Fill ``fields.options`` from an axolotl config; return the model it names."""
    base = fields.get("base_model")
    model = f"hf:{base}" if base else None
    if model:
        fields.honoured.append(f"base_model → {model}")
    _adapter(fields)
    for path, option in (
        ("micro_batch_size", "batch_size"),
        ("gradient_accumulation_steps", "grad_accum"),
        ("sequence_len", "seq_len"),
    ):
        value = fields.number(path)
        if value is not None:
            fields.honour(path, option, value)
    if fields.get("gradient_checkpointing") in (True, "unsloth"):
        fields.honour("gradient_checkpointing", "checkpointing", "full")
    name = fields.get("optimizer")
    if name is not None:
        optimizer, why = hf_optimizer(name)
        if optimizer is None:
            fields.note("optimizer", f"{name!r} is not modelled; counted as adamw")
        else:
            fields.honour("optimizer", "optimizer", optimizer, why)
    _precision(fields)
    for path, reason in _NOT_MODELLED.items():
        if fields.peek(path) not in (None, False, "", [], {}):
            fields.note(path, reason)
    return model
