"""Fused attention kernels that keep O(sequence) state, as custom ops with the memory of
the real kernels: FlashAttention-2 (the ``flash_attn`` package) and compiled FlexAttention.

Neither runs on a CPU, and fake tensors only need their allocations, so each kernel is a
``torch.library`` custom op whose fake implementation returns what the kernel returns —
the output and one fp32 log-sum-exp per (batch, head, query) row — and whose backward
allocates what the kernel's backward allocates. The CPU implementation computes the same
numbers as plain attention (no dropout), so the ops can be checked against SDPA::

    >>> q = k = v = torch.randn(1, 16, 2, 8)   # (batch, sequence, heads, head_dim)
    >>> out = fused_attention("flash2", q, k, v, causal=True)
    >>> ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
    ...                                      is_causal=True).transpose(1, 2)
    >>> bool(torch.allclose(out, ref, atol=1e-6))
    True

FlashAttention-2 (``csrc/flash_attn/flash_api.cpp`` ``mha_fwd``/``mha_bwd``): forward keeps
q, k, v, the output, the log-sum-exp (B, H, S) fp32 and a 2-int64 RNG state; backward
allocates dq, dk, dv like their inputs, ``softmax_d`` (B, H, S rounded up to 128) fp32,
``dq_accum`` (B, S rounded to 128, H, head_dim rounded to 32) fp32 and, for grouped-query
attention, dk/dv expanded to every query head before summing them per group. FlexAttention
(PyTorch's ``flex_attention`` higher-order op, compiled): forward keeps q, k, v, the output
(B, H, S, D) and the log-sum-exp; backward allocates dq, dk, dv, ``delta`` (B, H, S) fp32
and, for grouped-query attention, dk/dv broadcast to every query head.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

KERNELS = ("flash2", "flex")


def _round(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def _reference(q, k, v, scale, causal, window):
    """Plain attention in fp32 on (B, S, H, D) inputs with k and v expanded to every query
    head: (probabilities (B, H, Sq, Sk), expanded k, expanded v, out, log-sum-exp)."""
    heads, kv_heads = q.size(2), k.size(2)
    k_full = k.float().repeat_interleave(heads // kv_heads, dim=2)
    v_full = v.float().repeat_interleave(heads // kv_heads, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k_full) * scale
    len_q, len_k = q.size(1), k.size(1)
    rows = torch.arange(len_q).unsqueeze(1) + (len_k - len_q)  # bottom-right aligned
    cols = torch.arange(len_k).unsqueeze(0)
    hidden = torch.zeros(len_q, len_k, dtype=torch.bool)
    if causal:
        hidden |= cols > rows
    if window >= 0:
        hidden |= cols < rows - window
    scores = scores.masked_fill(hidden, -math.inf)
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v_full)
    return probs, k_full, v_full, out, torch.logsumexp(scores, dim=-1)


def _out_shape(q: Tensor, v: Tensor, heads_first: bool) -> tuple[int, ...]:
    batch, length, heads, _ = q.shape
    width = v.size(-1)
    return (batch, heads, length, width) if heads_first else (batch, length, heads, width)


@torch.library.custom_op("vramplan::fused_attention_forward", mutates_args=())
def _forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kernel: str,
    dropout_p: float,
    scale: float,
    causal: bool,
    window: int,
) -> tuple[Tensor, Tensor, Tensor]:
    _, _, _, out, lse = _reference(q, k, v, scale, causal, window)
    out = out.to(q.dtype)
    if kernel == "flex":
        out = out.transpose(1, 2).contiguous()
    return out, lse.contiguous(), torch.zeros(2 if kernel == "flash2" else 0, dtype=torch.int64)


@_forward.register_fake
def _forward_fake(q, k, v, kernel, dropout_p, scale, causal, window):
    out = q.new_empty(_out_shape(q, v, kernel == "flex"))
    lse = q.new_empty((q.size(0), q.size(2), q.size(1)), dtype=torch.float32)
    return out, lse, q.new_empty((2 if kernel == "flash2" else 0,), dtype=torch.int64)


@torch.library.custom_op(
    "vramplan::fused_attention_backward",
    mutates_args=("dq", "dk_full", "dv_full", "row_terms", "accumulator"),
)
def _backward_kernel(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dq: Tensor,
    dk_full: Tensor,
    dv_full: Tensor,
    row_terms: Tensor,
    accumulator: Tensor,
    kernel: str,
    scale: float,
    causal: bool,
    window: int,
) -> None:
    probs, k_full, v_full, out, _ = _reference(q, k, v, scale, causal, window)
    grad = dout.float().transpose(1, 2) if kernel == "flex" else dout.float()
    dv_full.copy_(torch.einsum("bhqk,bqhd->bkhd", probs, grad))
    dprobs = torch.einsum("bqhd,bkhd->bhqk", grad, v_full)
    row = torch.einsum("bqhd,bqhd->bhq", grad, out).unsqueeze(-1)
    row_terms[..., : q.size(1)].copy_(row.squeeze(-1))  # softmax_d / delta: rowsum(dO * O)
    dscores = probs * (dprobs - row) * scale
    dq.copy_(torch.einsum("bhqk,bkhd->bqhd", dscores, k_full))
    dk_full.copy_(torch.einsum("bhqk,bqhd->bkhd", dscores, q.float()))


@_backward_kernel.register_fake
def _backward_kernel_fake(
    dout, q, k, v, dq, dk_full, dv_full, row_terms, accumulator, kernel, scale, causal, window
):
    return None


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, kernel, dropout_p, scale, causal, window = inputs
    out, lse, rng_state = output
    ctx.save_for_backward(q, k, v, out, lse, rng_state)
    ctx.options = (kernel, scale, causal, window)


def _backward(ctx, dout, _dlse, _drng):
    q, k, v, out, lse, rng_state = ctx.saved_tensors
    kernel, scale, causal, window = ctx.options
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    batch, length, heads, width = q.shape
    kv_len, kv_heads = k.size(1), k.size(2)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if kernel == "flash2":  # softmax_d and dq_accum (mha_bwd)
        row_terms = q.new_empty((batch, heads, _round(length, 128)), dtype=torch.float32)
        head_rounded = _round(width, 32) if width <= 192 else 256
        accumulator = q.new_empty(
            (batch, _round(length, 128), heads, head_rounded), dtype=torch.float32
        )
    else:  # delta; no accumulator
        row_terms = q.new_empty((batch, heads, length), dtype=torch.float32)
        accumulator = q.new_empty((0,), dtype=torch.float32)
    grouped = kv_heads != heads
    if grouped:  # dk, dv for every query head, summed per group below
        dk_full = k.new_empty((batch, kv_len, heads, width))
        dv_full = v.new_empty((batch, kv_len, heads, v.size(-1)))
    else:
        dk_full, dv_full = dk, dv
    _backward_kernel(
        dout, q, k, v, dq, dk_full, dv_full, row_terms, accumulator, kernel, scale, causal, window
    )
    if grouped:
        groups = heads // kv_heads
        torch.sum(dk_full.reshape(batch, kv_len, kv_heads, groups, width), 3, out=dk)
        torch.sum(dv_full.reshape(batch, kv_len, kv_heads, groups, v.size(-1)), 3, out=dv)
    return dq, dk, dv, None, None, None, None, None


_forward.register_autograd(_backward, setup_context=_setup_context)


def fused_attention(
    kernel: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    scale: float | None = None,
    causal: bool = False,
    window: int = -1,
) -> Tensor:
    """Attention of (batch, sequence, heads, head_dim) inputs through ``kernel`` (``flash2``
    or ``flex``); the output is (B, S, H, D) for flash2 and (B, H, S, D) for flex, as each
    kernel writes it. ``window`` is a sliding window (tokens to the left; -1: none)."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown fused attention kernel {kernel!r}")
    width = q.size(-1)
    scale = scale if scale is not None else 1 / math.sqrt(width)
    if kernel == "flash2" and width % 8:  # flash_attn pads the head dimension to 8
        padded = [F.pad(t, (0, 8 - width % 8)) for t in (q, k, v)]
        out = _forward(*padded, kernel, dropout_p, scale, causal, window)[0]
        return out[..., :width]
    return _forward(q, k, v, kernel, dropout_p, scale, causal, window)[0]
