"""FP8 weights as transformers' fine-grained FP8 stores and runs them
(``integrations/finegrained_fp8.py`` ``FP8Linear``, transformers 5.23), on the meta device.

Every ``nn.Linear`` but the output head keeps its weight in float8_e4m3 ``[out, in]`` and
one fp32 ``weight_scale_inv`` per 128 × 128 block (``FineGrainedFP8Config``'s default
``weight_block_size``); the bias stays in the model's dtype. A forward calls the Triton
kernel's fused activation quantization and matmul (``finegrained_fp8.matmul``), which
writes the output in the input's dtype and keeps no dequantized weight; the bias is added
in place. Inference only here (``FP8LinearFunction``'s backward dequantizes for LoRA).

>>> layer = Fp8Linear(nn.Linear(4096, 11008, bias=False, device="meta"))
>>> layer.stored_bytes()  # 45,088,768 fp8 values + 86 x 32 fp32 block scales
45099776
"""

from __future__ import annotations

import torch
from torch import nn

from vramplan.errors import UserError

BLOCK = 128
FP8 = torch.float8_e4m3fn


class Fp8Linear(nn.Module):
    """A linear layer stored as fine-grained FP8 (weights and 128 × 128 block scales)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        device = linear.weight.device
        weight = torch.empty(self.out_features, self.in_features, dtype=FP8, device=device)
        self.weight = nn.Parameter(weight, requires_grad=False)
        scales = (-(-self.out_features // BLOCK), -(-self.in_features // BLOCK))
        scale = torch.empty(scales, dtype=torch.float32, device=device)
        self.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
        self.bias = linear.bias

    @property
    def logical_numel(self) -> int:
        """Elements of the full-precision weight this layer stands for."""
        return self.out_features * self.in_features

    def stored_bytes(self) -> int:
        """Bytes of the fp8 weight and its block scales (the bias not included)."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.weight_scale_inv))

    def _apply(self, fn, recurse=True):
        # ``model.to(torch.bfloat16)`` leaves the fp8 values and fp32 scales as stored.
        super()._apply(fn, recurse)
        for name, dtype in (("weight", FP8), ("weight_scale_inv", torch.float32)):
            tensor = self._parameters[name]
            if tensor.dtype != dtype:
                self._parameters[name] = nn.Parameter(tensor.to(dtype), requires_grad=False)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            raise UserError("fp8 layers are modelled for inference (--mode infer|generate)")
        out = torch.empty(*x.shape[:-1], self.out_features, dtype=x.dtype, device=x.device)
        if self.bias is not None:
            out.add_(self.bias.to(out.dtype))
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3"


def quantize_fp8_linears(model: nn.Module, skip: set[int]) -> int:
    """Replace every ``nn.Linear`` of ``model`` (but the modules in ``skip``, by id) with an
    ``Fp8Linear``; returns how many were replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and id(child) not in skip:
                setattr(parent, name, Fp8Linear(child))
                replaced += 1
    return replaced
