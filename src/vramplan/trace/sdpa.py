"""Scaled-dot-product attention as a CUDA GPU runs it, on the CPU trace.

The CPU picks its own SDPA kernel, and with an explicit mask it falls back to the math
path that keeps ``B·H·S·S`` probabilities; a CUDA GPU would run a fused kernel instead.
While tracing for CUDA, ``F.scaled_dot_product_attention`` is replaced by a stand-in with
the fused kernels' memory (PyTorch ``sdp_utils.cpp`` selection order: flash, then
memory-efficient, then math):

- flash (fp16/bf16, sm80+, head dim ≤ 256 and a multiple of 8, no explicit mask): keeps
  q, k, v, the output and an fp32 log-sum-exp of ``B·H·S``; backward adds fp32 ``dq``
  accumulation and ``B·H·S`` row sums;
- memory-efficient (any float dtype, masks allowed, head dim a multiple of 8 — 4 in fp32):
  keeps q, k, v, the mask, the output and an fp32 log-sum-exp padded to 32 rows;
- otherwise the math path runs as PyTorch composes it.

    >>> choose_backend(torch.bfloat16, head_dim=64, has_mask=False, arch="sm90")
    'flash'
"""

from __future__ import annotations

import math

import torch
from torch.overrides import TorchFunctionMode

_SDPA = torch.nn.functional.scaled_dot_product_attention


def _sm(arch: str) -> int:
    return int(arch[2:]) if arch.startswith("sm") and arch[2:].isdigit() else 80


def choose_backend(dtype: torch.dtype, head_dim: int, has_mask: bool, arch: str) -> str:
    """The fused kernel PyTorch would pick on ``arch``, or ``math``."""
    half = dtype in (torch.float16, torch.bfloat16)
    if half and _sm(arch) >= 80 and head_dim <= 256 and head_dim % 8 == 0 and not has_mask:
        return "flash"
    if dtype == torch.bfloat16 and _sm(arch) < 80:
        return "math"
    if head_dim % (8 if half else 4) == 0:
        return "efficient"
    return "math"


class _FusedAttention(torch.autograd.Function):
    """Allocates what a fused kernel allocates and keeps; values are irrelevant (fake)."""

    @staticmethod
    def forward(ctx, query, key, value, mask, backend: str):
        batch, heads, seq_q = query.shape[0], query.shape[1], query.shape[2]
        rows = seq_q if backend == "flash" else 32 * math.ceil(seq_q / 32)
        output = query.new_empty((*query.shape[:-1], value.shape[-1]))
        logsumexp = query.new_empty((batch, heads, rows), dtype=torch.float32)
        ctx.backend = backend
        saved = (query, key, value, output, logsumexp)
        ctx.save_for_backward(*(saved + ((mask,) if mask is not None else ())))
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, output, logsumexp = ctx.saved_tensors[:5]
        row_sums = logsumexp.new_empty(logsumexp.shape)
        if ctx.backend == "flash":
            accumulator = query.new_empty(query.shape, dtype=torch.float32)
            del accumulator
        del row_sums
        return (query.new_empty(query.shape), key.new_empty(key.shape),
                value.new_empty(value.shape), None, None)


class CudaAttention(TorchFunctionMode):
    """Routes SDPA calls to the stand-in of the kernel a CUDA GPU of ``arch`` would use."""

    def __init__(self, arch: str = "sm80") -> None:
        super().__init__()
        self.arch = arch
        self.backends: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not _SDPA:
            return func(*args, **kwargs)
        query, key, value = args[:3]
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        if kwargs.get("enable_gqa") and key.shape[-3] != query.shape[-3]:
            repeats = query.shape[-3] // key.shape[-3]
            key = key.repeat_interleave(repeats, dim=-3)
            value = value.repeat_interleave(repeats, dim=-3)
        backend = choose_backend(query.dtype, query.shape[-1], mask is not None, self.arch)
        self.backends.add(backend)
        if backend == "math" or query.dim() != 4:
            return func(*args, **kwargs)
        return _FusedAttention.apply(query, key, value, mask, backend)
