"""Scaled-dot-product attention as a CUDA GPU would run it, on the CPU's fake tensors.

``F.scaled_dot_product_attention`` picks its kernel by device. On the CPU, dropout (BERT,
GPT-2 and ViT train with it) rules out the fused kernel, so the math path runs and keeps
the whole (batch, heads, L, S) attention matrix for backward; a GPU would pick
FlashAttention and keep one fp32 log-sum-exp per row. While tracing for a GPU, the function
is swapped for one that applies the GPU's selection rules and calls the chosen kernel's
own ATen op, whose meta kernel and autograd formula PyTorch provides (so checkpoint
recompute and backward see the same kernel)::

    >>> q = k = v = torch.empty(2, 8, 128, 64, dtype=torch.float16, device="meta")
    >>> choose_backend(Attention.of(q, k, v, None, 0.1, True, True), "sm80")
    'flash'
    >>> choose_backend(Attention.of(q, k, v, None, 0.1, True, True), "sm75")
    'efficient'

The rules follow ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` (PyTorch 2.9 to
2.14): order cuDNN, flash, memory-efficient, math on sm90/sm100 (where the runtime cuDNN
is newer than 9.15, as the CUDA 13 wheels ship it), flash, memory-efficient, math
elsewhere; ROCm (gfx) has flash and memory-efficient through AOTriton and no cuDNN kernel.
From PyTorch 2.12 cuDNN takes a dropout only in steps of 1/16 (``check_cudnn_dropout``),
so the usual 0.1 of BERT or GPT-2 training goes to flash even on sm90 (2.11 ran it on
cuDNN, as a lent H200 showed)::

    >>> choose_backend(Attention.of(q, k, v, None, 0.1, True, True), "sm90")
    'flash'
    >>> choose_backend(Attention.of(q, k, v, None, 0.1, True, True), "sm90", dropout_steps=False)
    'cudnn'

A mask that requires a gradient (T5's learned relative position bias) runs on the math
kernel, which keeps the (L, S) probabilities: cuDNN refuses it (``check_attn_mask_shape``),
flash takes no mask, and PyTorch 2.11 on a lent H200 picked math over memory-efficient
attention for every such call of flan-t5 (``torch._fused_sdp_choice``).
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vramplan.native_stderr import quiet_native_stderr
from vramplan.trace.patching import patched

aten = torch.ops.aten
HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Attention:
    """What the selection rules look at in one call."""

    dtype: torch.dtype
    head_dim_qk: int
    head_dim_v: int
    heads_q: int
    heads_kv: int
    len_q: int
    len_kv: int
    has_mask: bool
    dropout: float
    is_causal: bool
    needs_grad: bool
    mask_needs_grad: bool = False
    """A learned bias as the mask (T5's relative position bias): no fused kernel takes it."""

    @classmethod
    def of(cls, q, k, v, attn_mask, dropout_p, is_causal, needs_grad) -> Attention:
        return cls(
            dtype=q.dtype,
            head_dim_qk=q.size(-1),
            head_dim_v=v.size(-1),
            heads_q=q.size(-3) if q.dim() >= 3 else 1,
            heads_kv=k.size(-3) if k.dim() >= 3 else 1,
            len_q=q.size(-2),
            len_kv=k.size(-2),
            has_mask=attn_mask is not None,
            dropout=dropout_p,
            is_causal=is_causal,
            needs_grad=needs_grad,
            mask_needs_grad=needs_grad and attn_mask is not None and attn_mask.requires_grad,
        )


def _sm(arch: str) -> tuple[int, int]:
    digits = arch.removeprefix("sm")
    return int(digits[:-1]), int(digits[-1])


def _low_precision(a: Attention, major: int) -> bool:
    return a.dtype in (HALF if major >= 8 else (torch.float16,))


def _flash_ok(a: Attention, arch: str) -> bool:
    if a.has_mask or a.head_dim_qk != a.head_dim_v or a.head_dim_qk > 256:
        return False
    if a.is_causal and a.len_q != a.len_kv:
        return False
    if a.heads_q % a.heads_kv:
        return False
    if arch.startswith("gfx"):
        return a.dtype in HALF
    major, minor = _sm(arch)
    if (major, minor) < (8, 0) or not _low_precision(a, major):
        return False
    if a.needs_grad and ((major, minor) in ((8, 6), (8, 7), (8, 8), (8, 9)) or major == 12):
        too_wide = 192 < a.head_dim_qk <= 224 or (a.head_dim_qk > 224 and a.dropout > 0)
        if too_wide:
            return False
    return True


def _efficient_ok(a: Attention, arch: str) -> bool:
    if a.heads_q != a.heads_kv:  # no grouped-query attention
        return False
    if arch.startswith("gfx"):
        aligned = a.head_dim_qk % (8 if a.dtype in HALF else 4) == 0
        return a.head_dim_qk == a.head_dim_v and a.head_dim_qk <= 256 and aligned
    major, _ = _sm(arch)
    if major < 5:
        return False
    half = a.dtype in HALF
    alignment = 4 if major >= 8 else 1
    if major >= 8 or (major >= 7 and half):  # tensor cores
        alignment = max(alignment, 128 // (16 if half else 32))
    if a.head_dim_qk % alignment or a.head_dim_v % alignment:
        return False
    allowed = (
        (torch.float16, torch.float32, torch.bfloat16)
        if major >= 8
        else (torch.float16, torch.float32)
    )
    return a.dtype in allowed


def _cudnn_ok(a: Attention, arch: str, dropout_steps: bool) -> bool:
    major, minor = _sm(arch)
    if not _low_precision(a, major):
        return False
    limit = 256 if (major, minor) == (9, 0) else 128
    if max(a.head_dim_qk, a.head_dim_v) > limit or a.head_dim_qk % 8 or a.head_dim_v % 8:
        return False
    if dropout_steps and a.dropout * 16 != math.floor(a.dropout * 16):  # steps of 1/16
        return False
    return a.len_kv > 1 and not (a.len_q == 1 and a.dropout > 0)


def choose_backend(a: Attention, arch: str, dropout_steps: bool = True) -> str:
    """The kernel PyTorch's CUDA dispatcher picks: cudnn, flash, efficient or math
    (``dropout_steps``: PyTorch 2.12+, where cuDNN takes dropout only in 1/16 steps)."""
    if a.mask_needs_grad:
        return "math"
    cudnn_first = not arch.startswith("gfx") and _sm(arch) in ((9, 0), (10, 0))
    if cudnn_first and _cudnn_ok(a, arch, dropout_steps):
        return "cudnn"
    if _flash_ok(a, arch):
        return "flash"
    if _efficient_ok(a, arch):
        return "efficient"
    return "math"


def _autocast(*tensors):
    """SDPA is on CUDA autocast's lower-precision list: cast floating inputs."""
    if not torch.is_autocast_enabled("cpu"):
        return tensors
    dtype = torch.get_autocast_dtype("cpu")
    return tuple(
        t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in tensors
    )


def _additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask becomes an additive bias, as the fused kernels take it."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, -math.inf)


def _aligned_bias(bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The memory-efficient kernel's bias: last dimension padded to 16, expanded to
    (batch, heads, L, S) (``preprocess_mask`` in attention.cpp)."""
    length = k.size(-2)
    if length % 16:
        bias = F.pad(bias, (0, 16 - length % 16))[..., :length]
    return bias.expand(*q.shape[:-1], length)


def _pad_head(t: torch.Tensor) -> torch.Tensor:
    width = t.size(-1)
    return F.pad(t, (0, 8 - width % 8)) if width % 8 else t


def _run(backend, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, needs_grad):
    if backend == "flash":
        width = q.size(-1)
        scale = scale if scale is not None else 1 / math.sqrt(width)
        out = aten._scaled_dot_product_flash_attention(
            _pad_head(q), _pad_head(k), _pad_head(v), dropout_p, is_causal, scale=scale
        )[0]
        return out[..., :width] if out.size(-1) != width else out
    if backend == "cudnn":
        bias = _additive_mask(attn_mask, q.dtype)
        return aten._scaled_dot_product_cudnn_attention(
            q, k, v, bias, needs_grad, dropout_p, is_causal, False, scale=scale
        )[0]
    if backend == "efficient":
        bias = _additive_mask(attn_mask, q.dtype)
        if bias is not None:
            bias = _aligned_bias(bias, q, k)
        return aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, needs_grad, dropout_p, is_causal, scale=scale
        )[0]
    return aten._scaled_dot_product_attention_math(
        q,
        k,
        v,
        attn_mask,
        dropout_p,
        is_causal,
        _dropout_mask(q, k, dropout_p),
        scale=scale,
        enable_gqa=enable_gqa,
    )[0]


@functools.cache
def _quiet_testing_warning() -> None:
    """The math kernel's ``dropout_mask`` path logs "Dropout mask should only be used for
    testing purposes" once per process, from C++: spend that once on a tiny call, quietly."""
    one = torch.zeros(1, 1, 2, 8)
    with quiet_native_stderr():
        aten._scaled_dot_product_attention_math(
            one, one, one, None, 0.5, False, torch.ones(1, 1, 2, 2, dtype=torch.bool)
        )


def _dropout_mask(q: torch.Tensor, k: torch.Tensor, dropout_p: float) -> torch.Tensor | None:
    """The math kernel's dropout as CUDA runs it. Its ``at::dropout`` on a CUDA tensor is
    ``native_dropout``, which keeps a 1-byte mask of the (B, H, L, S) probabilities; on the
    CPU it would keep a noise tensor of their dtype (fp32: 4 bytes each). Handing the
    kernel a bool mask (its ``dropout_mask`` argument) keeps what CUDA keeps: the mask and
    the dropped probabilities."""
    if dropout_p <= 0.0:
        return None
    _quiet_testing_warning()
    return torch.empty(*q.shape[:-1], k.size(-2), dtype=torch.bool)


def cuda_sdpa(
    arch: str, calls: dict[str, int], dropout_steps: bool = True
) -> contextlib.AbstractContextManager:
    """Route ``F.scaled_dot_product_attention`` to the kernel a GPU of ``arch`` picks,
    counting the choices in ``calls``."""
    original = F.scaled_dot_product_attention

    def scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
    ):
        if query.is_nested or query.dim() != 4:
            return original(
                query,
                key,
                value,
                attn_mask,
                dropout_p,
                is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        query, key, value, attn_mask = _autocast(query, key, value, attn_mask)
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        shape = Attention.of(query, key, value, attn_mask, dropout_p, is_causal, needs_grad)
        backend = choose_backend(shape, arch, dropout_steps)
        if backend != "math" and shape.heads_q != shape.heads_kv and not enable_gqa:
            backend = "math"  # without enable_gqa the head counts must match
        calls[backend] = calls.get(backend, 0) + 1
        with torch.autocast("cpu", enabled=False):
            return _run(
                backend,
                query,
                key,
                value,
                attn_mask,
                dropout_p,
                is_causal,
                scale,
                enable_gqa,
                needs_grad,
            )

    return patched([(F, "scaled_dot_product_attention", scaled_dot_product_attention)])
