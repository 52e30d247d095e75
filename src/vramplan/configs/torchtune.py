"""torchtune's recipe YAML: the model builder (and its LoRA / QLoRA arguments), batch,
accumulation, ``tokenizer.max_seq_len``, optimizer, dtype, activation checkpointing.

    >>> fields = Fields({"model": {"_component_": "torchtune.models.llama3_1.lora_llama3_1_8b",
    ...     "lora_attn_modules": ["q_proj", "v_proj", "output_proj"], "lora_rank": 8,
    ...     "lora_alpha": 16}, "batch_size": 2, "dtype": "bf16"})
    >>> read_torchtune(fields)
    'hf:meta-llama-3-8b'
    >>> fields.options["lora_targets"]
    'q_proj,v_proj,o_proj'
"""

from __future__ import annotations

from vramplan.configs.fields import Fields
from vramplan.configs.names import class_optimizer
from vramplan.errors import UserError

MODELS = {
    "llama3_8b": "meta-llama-3-8b",
    "llama3_1_8b": "meta-llama-3-8b",
    "llama3_70b": "meta-llama-3-70b",
    "llama3_1_70b": "meta-llama-3-70b",
    "llama2_7b": "llama-2-7b",
    "llama2_13b": "llama-2-13b",
    "mistral_7b": "mistral-7b-v0.1",
    "qwen2_5_0_5b": "qwen2.5-0.5b",
    "qwen2_5_7b_base": "qwen2.5-7b",
    "qwen2_5_7b_instruct": "qwen2.5-7b",
}
"""torchtune builders (without ``lora_`` / ``qlora_``) and the bundled Hugging Face config
with the same shapes (Llama 3.1 differs from Llama 3 only in RoPE scaling and context)."""
GROUPED_QUERY = {name for name in MODELS if not name.startswith("llama2")}
"""The builders with grouped-query attention (fewer key/value heads than query heads):
torchtune's ``MultiHeadAttention`` repeats their K and V to every query head before SDPA
(``k.unsqueeze(2).expand(...).flatten(1, 2)``, torchtune 0.6.1), which ``--repeat-kv``
traces; Llama 2 7B and 13B have as many key/value heads as query heads."""
ATTENTION = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj"}
MLP = ("gate_proj", "up_proj", "down_proj")
_NOT_MODELLED = {"fsdp_cpu_offload": "FSDP CPU offload is not modelled"}
_TRICKS = {
    "enable_activation_offloading": (
        "activation_offload",
        "OffloadActivations: saved tensors to pinned host memory",
    ),
    "optimizer_in_bwd": ("optimizer_in_backward", "each parameter's step in its gradient hook"),
    "model.use_dora": ("dora", "peft's DoRA magnitude vectors"),
}
"""torchtune fields that turn on a memory saver vramplan traces, and the flag each is."""
CHUNKS_DEFAULT = 8
"""``CEWithChunkedOutputLoss(num_output_chunks=8)``'s default (torchtune/modules/loss)."""


def _model(fields: Fields) -> str | None:
    component = fields.get("model._component_")
    if component is None:
        fields.notes.append("no model._component_: give the model on the command line")
        return None
    builder = str(component).rsplit(".", 1)[-1]
    base = builder.removeprefix("qlora_").removeprefix("lora_")
    if builder.startswith(("lora_", "qlora_")):
        _lora(fields, builder.startswith("qlora_"))
    name = MODELS.get(base)
    if name is None:
        fields.note(
            "model._component_",
            f"{component} has no bundled config here: give the "
            "model on the command line (hf:path/config.json)",
        )
        return None
    fields.honoured.append(f"model._component_ → hf:{name}")
    if base in GROUPED_QUERY:
        fields.honour(
            "model._component_",
            "repeat_kv",
            True,
            "MultiHeadAttention repeats K and V to every query head before SDPA",
        )
    return f"hf:{name}"


def _lora(fields: Fields, qlora: bool) -> None:
    modules = fields.get("model.lora_attn_modules") or []
    unknown = [m for m in modules if m not in ATTENTION]
    if unknown:
        raise UserError(
            f"model.lora_attn_modules: unknown module {unknown[0]!r} "
            f"(torchtune names: {', '.join(ATTENTION)})"
        )
    targets = [ATTENTION[m] for m in modules]
    if fields.get("model.apply_lora_to_mlp") is True:
        targets += MLP
    if fields.get("model.apply_lora_to_output") is True:
        targets.append("lm_head")
    rank = fields.number("model.lora_rank")
    if rank is None:
        raise UserError("a LoRA builder needs model.lora_rank")
    fields.honour("model.lora_rank", "lora", rank)
    if targets:
        fields.honour("model.lora_attn_modules", "lora_targets", ",".join(targets))
    alpha = fields.get("model.lora_alpha")
    if alpha is not None:
        fields.honour("model.lora_alpha", "lora_alpha", float(alpha))
    dropout = fields.get("model.lora_dropout")
    if dropout:
        fields.honour("model.lora_dropout", "lora_dropout", float(dropout))
    if qlora or fields.get("model.quantize_base") is True:
        fields.honour("model._component_", "quantize", "nf4", "torchao NF4 base weights")
        fields.honour("model._component_", "double_quant", True, "torchao quantizes the scales")


def _precision(fields: Fields) -> None:
    dtype = str(fields.get("dtype", "fp32")).lower()
    if dtype not in ("bf16", "fp32"):
        raise UserError(
            f"dtype must be bf16 or fp32 (torchtune has no fp16 training), got {dtype!r}"
        )
    if dtype == "bf16":
        fields.honour(
            "dtype", "precision", "bf16", "weights, gradients and optimizer state in bf16"
        )


def read_torchtune(fields: Fields) -> str | None:
    """Fill ``fields.options`` from a torchtune recipe; return the model it names."""
    model = _model(fields)
    batch = fields.number("batch_size")
    if batch is not None:
        fields.honour("batch_size", "batch_size", batch)
    accum = fields.number("gradient_accumulation_steps")
    if accum is not None:
        fields.honour("gradient_accumulation_steps", "grad_accum", accum)
    seq_len = fields.number("tokenizer.max_seq_len")
    if seq_len is not None:
        fields.honour(
            "tokenizer.max_seq_len", "seq_len", seq_len, "every sample padded or packed to it"
        )
    else:
        fields.notes.append(
            "tokenizer.max_seq_len is not set: give --seq-len (your longest sample)"
        )
    component = fields.get("optimizer._component_")
    if component is not None:
        optimizer, why = class_optimizer(component)
        if optimizer is None:
            fields.note("optimizer._component_", f"{component} is not modelled; counted as adamw")
        else:
            fields.honour("optimizer._component_", "optimizer", optimizer, why)
    _precision(fields)
    if fields.get("enable_activation_checkpointing") is True:
        fields.honour("enable_activation_checkpointing", "checkpointing", "full")
    if fields.get("compile") is True:
        fields.honour(
            "compile",
            "compile",
            True,
            "training.compile_model: each decoder layer; compile_loss: the chunked loss's "
            "cross-entropy",
        )
    for path, (option, why) in _TRICKS.items():
        if fields.get(path) is True:
            fields.honour(path, option, True, why)
    for path, reason in _NOT_MODELLED.items():
        if fields.peek(path) not in (None, False):
            fields.note(path, reason)
    loss = fields.peek("loss._component_")
    if loss and "CEWithChunkedOutputLoss" in str(loss):
        chunks = fields.number("loss.num_output_chunks") or CHUNKS_DEFAULT
        fields.honour("loss._component_", "loss_chunks", chunks, "the logits upcast chunk by chunk")
    fields.notes.append(
        "a distributed recipe's GPU count comes from `tune run --nproc_per_node`: give --fsdp N"
    )
    return model
