"""The dtypes a framework stores parameters in, applied to the meta model before tracing.

The recipe's parameter dtype first (``model.to(bfloat16)`` for pure bf16, or a Hugging Face
model loaded with ``torch_dtype=bfloat16`` and trained under ``bf16=True`` autocast:
``--weights-dtype bf16``), then the fp32 islands a half-precision model keeps.

transformers' ``from_pretrained`` keeps some of a model's weights in fp32 whatever dtype
it is asked for (``PreTrainedModel._get_dtype_plan``): ``_keep_in_fp32_modules`` under
fp16 (T5's and UMT5's feed-forward output ``wo``, GPT-OSS's norms: fp16 overflows there)
and ``_keep_in_fp32_modules_strict`` under fp16 and bf16 (the routers of DeepSeek-V3,
GLM-4.5 and other MoE models: ``gate.weight`` and the ``e_score_correction_bias``
buffer). Its loader matches each pattern anywhere in a checkpoint key
(``core_model_loading``: ``*`` as ``.*``, a regex ``search``); ``fp32_plan`` does the
same over the model's parameters and buffers, so the traced forward meets the casts the
model's code makes for them (T5 casts the activations into ``wo`` to its dtype).

Then the islands the user names (``--keep-fp32 PATTERNS``, fnmatch over parameter names):

- peft's ``get_peft_model(..., autocast_adapter_dtype=True)`` (its default since 0.12)
  upcasts bf16/fp16 LoRA adapters to fp32: ``*lora_*``;
- TRL's ``SFTTrainer`` with a 4-bit model and ``bf16=True`` calls
  ``peft_module_casting_to_bf16``: every module with ``norm`` in its name back in fp32,
  embeddings and head in bf16: ``*norm*``.

>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
>>> cast_parameters(model, Recipe(precision="bf16", keep_fp32="1.*"))
>>> [p.dtype for p in model.parameters()]
[torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]
"""

from __future__ import annotations

import re
from fnmatch import fnmatchcase

import torch
from torch import nn

from vramplan.errors import UserError
from vramplan.recipe import Recipe


def fp32_plan(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """The names of the parameters and buffers transformers' ``from_pretrained`` would keep
    in fp32 when asked for ``dtype`` (see the module docstring); none for other models.

    >>> from transformers import T5Config, T5ForConditionalGeneration
    >>> config = T5Config(d_model=8, d_ff=16, d_kv=4, num_layers=1, num_heads=2, vocab_size=32)
    >>> t5 = T5ForConditionalGeneration(config)
    >>> [name.split(".DenseReluDense")[0] for name in fp32_plan(t5, torch.float16)]
    ['encoder.block.0.layer.1', 'decoder.block.0.layer.2']
    >>> fp32_plan(t5, torch.bfloat16)
    []
    """
    patterns = []
    if dtype == torch.float16:
        patterns += list(getattr(model, "_keep_in_fp32_modules", None) or ())
    if dtype in (torch.float16, torch.bfloat16):
        patterns += list(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if not patterns:
        return []
    plan = re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in patterns))
    named = [*model.named_parameters(), *model.named_buffers()]
    return [name for name, t in named if t.is_floating_point() and plan.search(name)]


def cast_parameters(model: nn.Module, recipe: Recipe) -> str | None:
    """Store ``model``'s parameters as the recipe says (in place); the note naming what
    transformers keeps in fp32, if anything."""
    dtype = getattr(torch, recipe.param_dtype_name)
    note = None
    if dtype != torch.float32:
        kept = fp32_plan(model, dtype)
        model.to(dtype)
        _to_fp32(model, kept)
        if kept:
            note = (
                f"{len(kept)} weights kept in fp32 as transformers' from_pretrained keeps "
                f"them under {recipe.param_dtype_name} (the model's _keep_in_fp32_modules or "
                f"_keep_in_fp32_modules_strict), e.g. {kept[0]}"
            )
    keep = [p.strip() for p in (recipe.keep_fp32 or "").split(",") if p.strip()]
    if not keep:
        return note
    named = list(model.named_parameters())
    for pattern in keep:
        if not any(fnmatchcase(name, pattern) for name, _ in named):
            example = named[0][0] if named else "(none)"
            raise UserError(
                f"--keep-fp32 {pattern!r} matches no parameter name (names look like {example!r})"
            )
    _to_fp32(
        model,
        [
            name
            for name, param in named
            if param.is_floating_point() and any(fnmatchcase(name, p) for p in keep)
        ],
    )
    return note


def _to_fp32(model: nn.Module, names: list[str]) -> None:
    """Parameters (in place, keeping the ``Parameter``) and buffers named ``names`` in fp32."""
    for name in names:
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if leaf in owner._parameters:
            owner._parameters[leaf].data = owner._parameters[leaf].data.to(torch.float32)
        else:
            owner._buffers[leaf] = owner._buffers[leaf].to(torch.float32)
