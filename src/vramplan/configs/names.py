"""The names other tools give optimizers and precisions, in vramplan's words.

>>> hf_optimizer("paged_adamw_8bit")[0]
'adam8bit'
>>> class_optimizer("bitsandbytes.optim.PagedAdamW8bit")[0]
'adam8bit'
"""

from __future__ import annotations

PAGED = (
    "paged: bitsandbytes pages optimizer state to host memory only under pressure; "
    "counted on the GPU"
)

_HF = {
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw",
    "adamw_hf": "adamw",
    "adamw_apex_fused": "adamw",
    "adamw_anyprecision": "adamw",
    "adamw_torch_4bit": "adam8bit",
    "adamw_torch_8bit": "adam8bit",
    "adamw_bnb_8bit": "adam8bit",
    "adamw_8bit": "adam8bit",
    "bnb_8bit": "adam8bit",
    "paged_adamw_8bit": "adam8bit",
    "paged_adamw_32bit": "adamw",
    "paged_adamw": "adamw",
    "adafactor": "adafactor",
    "sgd": "sgd",
    "adagrad": "adagrad",
    "rmsprop": "rmsprop",
    "lion_32bit": "lion",
    "paged_lion_32bit": "lion",
}
"""transformers' ``OptimizerNames`` (also axolotl's ``optimizer``)."""

_CLASSES = {
    "adamw": "adamw",
    "adam": "adam",
    "fusedadam": "adamw",
    "deepspeedcpuadam": "adamw",
    "adamw8bit": "adam8bit",
    "pagedadamw8bit": "adam8bit",
    "adam8bit": "adam8bit",
    "pagedadamw": "adamw",
    "sgd": "sgd",
    "adagrad": "adagrad",
    "rmsprop": "rmsprop",
    "adafactor": "adafactor",
    "lion": "lion",
    "lamb": "adamw",
    "fusedlamb": "adamw",
    "onebitadam": "adamw",
    "zerooneadam": "adamw",
    "onebitlamb": "adamw",
}
"""Optimizer class names (``torch.optim.AdamW``, ``bitsandbytes.optim.PagedAdamW8bit``,
DeepSpeed's ``"type": "Lamb"``), lower case, without the module."""


def hf_optimizer(name: str) -> tuple[str | None, str]:
    """vramplan's optimizer for a transformers ``optim`` name, and a note (``None``: unknown)."""
    key = str(name).strip().lower()
    note = PAGED if key.startswith("paged_") else ""
    return _HF.get(key), note


def class_optimizer(name: str) -> tuple[str | None, str]:
    """vramplan's optimizer for a class path such as ``torch.optim.AdamW``, and a note."""
    key = str(name).rsplit(".", 1)[-1].strip().lower()
    optimizer = _CLASSES.get(key)
    note = PAGED if key.startswith("paged") else ""
    if key in ("lamb", "fusedlamb", "onebitlamb"):
        note = "LAMB keeps Adam's two moments: counted as adamw"
    return optimizer, note
