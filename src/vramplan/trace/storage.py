"""The dtypes a framework stores parameters in, applied to the meta model before tracing.

The recipe's parameter dtype first (``model.to(bfloat16)`` for pure bf16, or a Hugging Face
model loaded with ``torch_dtype=bfloat16`` and trained under ``bf16=True`` autocast:
``--weights-dtype bf16``), then the fp32 islands frameworks keep in a half-precision model
(``--keep-fp32 PATTERNS``, fnmatch over parameter names):

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

from fnmatch import fnmatchcase

import torch
from torch import nn

from vramplan.errors import UserError
from vramplan.recipe import Recipe


def cast_parameters(model: nn.Module, recipe: Recipe) -> None:
    """Store ``model``'s parameters as the recipe says (in place)."""
    dtype = getattr(torch, recipe.param_dtype_name)
    if dtype != torch.float32:
        model.to(dtype)
    keep = [p.strip() for p in (recipe.keep_fp32 or "").split(",") if p.strip()]
    if not keep:
        return
    named = list(model.named_parameters())
    for pattern in keep:
        if not any(fnmatchcase(name, pattern) for name, _ in named):
            example = named[0][0] if named else "(none)"
            raise UserError(
                f"--keep-fp32 {pattern!r} matches no parameter name (names look like {example!r})"
            )
    for name, param in named:
        if param.is_floating_point() and any(fnmatchcase(name, p) for p in keep):
            param.data = param.data.to(torch.float32)
