"""Scratch a CUDA kernel allocates inside one call and frees before it returns: invisible
to the meta kernels fake tensors run (they return only the outputs), yet requests to the
caching allocator that shape its segments.

**Reductions** (``aten/src/ATen/native/cuda/Reduce.cuh``, ``setReduceConfig`` and
``gpu_reduce_kernel``): a reduction long enough is split across thread blocks, which
then need a staging buffer (``global_memory_size``: accumulator bytes x outputs x blocks
per output, x threads across outputs when the outputs lie along the fastest dimension)
and a semaphore per block column, both from the caching allocator. A bias's or a norm
weight's gradient is such a sum over every token: 56 MiB of staging for Qwen2.5-0.5B's
896-wide q bias at 8 x 1024 tokens on a 132-multiprocessor card::

    >>> card = Card(multiprocessors=132)
    >>> reduction_scratch((8192, 896), (896, 1), 0, (0,), 4, card)
    (58720256, 28)
    >>> reduction_scratch((8192, 896), (896, 1), 0, (1,), 4, card)  # along the rows: none
    ()

**Fused attention backward** (``_scaled_dot_product_{cudnn,flash,efficient}_attention_
backward``), after its dq, dk, dv: cuDNN's workspace (an fp32 dQ accumulator and
row sums, and dK/dV for every query head under grouped-query attention: cudnn-frontend's
SDPA backward); FlashAttention-2's ``softmax_d`` and ``dq_accum`` (rows rounded to 128,
head dim to 32) and, under grouped-query attention, dk/dv expanded to every query head
(``mha_bwd``); the memory-efficient kernel's ``delta`` and its fp32 grad-q accumulator
(rows rounded to its 64- or 128-row tile, head dim to 64 or 128) with 16 bytes per tile::

    >>> q, kv = (8, 14, 1024, 64), (8, 2, 1024, 64)   # Qwen2.5-0.5B's heads
    >>> attention_scratch("cudnn", q, kv, kv, 2)   # and 256 bytes more, in every call measured
    (59179264,)
    >>> attention_scratch("flash", q, kv, kv, 2)
    (458752, 29360128, 14680064, 14680064)

**Strided inputs made contiguous**: ``topk``'s kernel (``launch_gather_topk_kernel``)
starts with ``auto input = self.contiguous()``, so a strided input (a split of the RPN's
objectness, one slice of the anchors of every image) costs a dense copy for the call::

    >>> import torch
    >>> with torch.device("meta"):
    ...     objectness = torch.empty(2, 242991)
    >>> level = objectness[:, :201600]   # what ``objectness.split(...)`` hands ``topk``
    >>> KernelScratch(Card()).sizes("topk", torch.ops.aten.topk.default, (level, 2000), {})
    (1612800,)

Every figure above is what a lent H200 (torch 2.11, CUDA 13.0, cuDNN 9.19) allocated
(``benchmarks/results/gpu-nvidia-h200-2026-11-30``: ``reduce_workspace.json``,
``sdpa_workspace.json``, from ``python -m benchmarks.gpu_harvest.reduce_workspace`` and
``.sdpa_workspace``); the copy is the 1.54 MiB request its snapshots of Faster R-CNN's
step show at ``rpn.py:237`` (6.15 MiB at batch 8). The launch configuration reads the
card's multiprocessor count and threads per multiprocessor; ROCm builds use 64-lane
wavefronts, at least 64 blocks per split output and 128 values per thread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vramplan.trace.arguments import bound_arguments

MAX_THREADS = 512  # mnt_wrapper<T>::MAX_NUM_THREADS (256 only for complex double)
MAX_VALUES_PER_THREAD = 256
INPUT_VEC = 4  # vt0 / input_vec_size of the sum, mean and norm kernels
ATTENTION_KERNELS = {
    "_scaled_dot_product_cudnn_attention_backward": "cudnn",
    "_scaled_dot_product_flash_attention_backward": "flash",
    "_scaled_dot_product_efficient_attention_backward": "efficient",
}
CUDNN_PAD = 256  # every measured cuDNN SDPA backward workspace held 256 bytes beyond its terms
WELFORD = ("var_mean", "var", "std", "std_mean")
REDUCTIONS = ("sum", "mean", "amax", "amin", "linalg_vector_norm", *WELFORD)
CONTIGUOUS_FIRST = ("topk",)
"""Ops whose CUDA kernel copies a strided input to a contiguous one before it runs."""


@dataclass(frozen=True)
class Card:
    """What a reduction's launch configuration reads of the GPU."""

    multiprocessors: int = 108
    threads_per_multiprocessor: int = 2048
    rocm: bool = False

    @property
    def warp_size(self) -> int:
        return 64 if self.rocm else 32


def _last_pow2(n: int) -> int:
    return max(1, 1 << (max(1, n).bit_length() - 1))


@dataclass(frozen=True)
class _Iteration:
    """A reduction as TensorIterator lays it out: reduced dimensions first, each group by
    ascending input stride, adjacent dimensions coalesced, size-1 dimensions dropped."""

    reduced: list[tuple[int, int]]
    kept: list[tuple[int, int]]

    @classmethod
    def of(cls, shape, strides, dims) -> _Iteration:
        wanted = set(range(len(shape))) if dims is None else {d % len(shape) for d in dims}
        groups: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
        for axis, (size, stride) in enumerate(zip(shape, strides, strict=True)):
            if size != 1:
                groups[axis in wanted].append((size, stride))
        return cls(*(_coalesced(sorted(groups[r], key=lambda d: d[1])) for r in (True, False)))


def _coalesced(dims: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for size, stride in dims:
        if out and stride == out[-1][0] * out[-1][1]:
            out[-1] = (out[-1][0] * size, out[-1][1])
        else:
            out.append((size, stride))
    return out


def _output_vec(layout: _Iteration, offset: int) -> int:
    """``get_output_vec_size``: 4, halved until it divides the base offset, the first kept
    dimension's size and every other input stride (in elements)."""
    numbers = [offset, layout.kept[0][0]]
    numbers += [stride for _, stride in layout.reduced] + [s for _, s in layout.kept[1:]]
    vec = 4
    for n in numbers:
        while n % vec:
            vec //= 2
    return vec


def reduction_scratch(
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    offset: int,
    dims: tuple[int, ...] | None,
    accumulator_bytes: int,
    card: Card,
) -> tuple[int, ...]:
    """(staging buffer, semaphores) bytes of one ``gpu_reduce_kernel`` call over ``dims``
    (None: all) of a tensor laid out as ``shape``/``strides`` (elements), or () when the
    reduction stays inside each block. ``accumulator_bytes``: 4 for a float sum, mean or
    norm (fp16/bf16 accumulate in fp32), the element size for amax/amin, 16 for Welford."""
    layout = _Iteration.of(shape, strides, dims)
    if not layout.reduced:
        return ()
    outputs = math.prod(size for size, _ in layout.kept)
    inputs = math.prod(size for size, _ in layout.reduced)
    fastest = not layout.kept or layout.reduced[0][1] < layout.kept[0][1]
    dim0, dim1 = (inputs, outputs) if fastest else (outputs, inputs)
    output_vec = 1
    if (layout.reduced[0][1] if fastest else layout.kept[0][1]) == 1:
        if fastest and dim0 >= 128 and len(layout.reduced) == 1:
            dim0 //= INPUT_VEC
        elif not fastest:
            output_vec = _output_vec(layout, offset)
            dim0 //= output_vec
    most = MAX_THREADS // output_vec
    pow0 = _last_pow2(dim0) if dim0 < most else most
    pow1 = _last_pow2(dim1) if dim1 < most else most
    width = min(pow0, card.warp_size)
    height = min(pow1, most // width)
    width = min(pow0, most // height)
    step_input, step_output = (width, 1) if fastest else (1, width)
    across_warps = math.ceil(inputs / step_input) >= min(height * 16, MAX_VALUES_PER_THREAD)
    if across_warps:
        step_input *= height
    else:
        step_output *= height
    per_thread = math.ceil(inputs / step_input)
    grid = math.ceil((outputs // output_vec) / step_output)
    target = card.multiprocessors * (card.threads_per_multiprocessor // (width * height))
    if not across_warps or per_thread < MAX_VALUES_PER_THREAD or grid > target:
        return ()
    least = 128 if card.rocm else 16
    blocks = min(
        max(math.ceil(target / grid), math.ceil(per_thread / MAX_VALUES_PER_THREAD)),
        math.ceil(per_thread / least),
    )
    if blocks <= 1:
        return ()
    if card.rocm:
        blocks = max(blocks, 64)
    staging = accumulator_bytes * outputs * blocks * (1 if fastest else width * output_vec)
    return (staging, 4 * grid)


def _round(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def attention_scratch(
    kernel: str,
    query: tuple[int, ...],
    key: tuple[int, ...],
    value: tuple[int, ...],
    element_bytes: int,
) -> tuple[int, ...]:
    """The scratch of one fused attention backward call on (batch, heads, length, dim)
    query, key and value, in the order the kernel allocates it (after dq, dk, dv)."""
    batch, heads, len_q, dim = query
    kv_heads, len_k, dim_v = key[1], key[2], value[3]
    grouped = kv_heads != heads
    if kernel == "cudnn":
        expanded = element_bytes * batch * heads * len_k * (dim + dim_v) if grouped else 0
        return (4 * batch * heads * len_q * (dim + 1) + expanded + CUDNN_PAD,)
    if kernel == "flash":
        rows = _round(len_q, 128)
        scratch = (4 * batch * heads * rows, 4 * batch * rows * heads * _round(dim, 32))
        if grouped:
            scratch += (element_bytes * batch * len_k * heads * dim,)
            scratch += (element_bytes * batch * len_k * heads * dim_v,)
        return scratch
    if kernel == "efficient":
        tile = 64 if dim <= 64 else 128
        padded = 64 if dim <= 64 else 128 if dim <= 128 else dim
        tiles = batch * heads * math.ceil(len_q / tile)
        accumulator = 4 * batch * heads * _round(len_q, tile) * padded + 16 * tiles
        return (4 * batch * heads * len_q, accumulator)
    return ()


def _accumulator_bytes(name: str, x) -> int:
    """A tensor's accumulator: fp32 for floats up to 32 bits, 64 bits for doubles and
    integers (sums of integers accumulate in int64), the element for amax/amin."""
    if name in ("amax", "amin"):
        return x.element_size()
    wide = 4 if x.dtype.is_floating_point and x.element_size() <= 4 else 8
    return 4 * wide if name in WELFORD else wide


class KernelScratch:
    """The scratch sizes of one dispatched op on ``card``, for the trace recorder."""

    def __init__(self, card: Card) -> None:
        self.card = card

    def sizes(self, name: str, func, args: tuple, kwargs: dict) -> tuple[int, ...]:
        """The bytes ``func`` (whose op name is ``name``) allocates and frees inside."""
        if name in ATTENTION_KERNELS:
            q, k, v = args[1:4]
            return attention_scratch(
                ATTENTION_KERNELS[name],
                tuple(q.shape),
                tuple(k.shape),
                tuple(v.shape),
                q.element_size(),
            )
        if name not in REDUCTIONS and name not in CONTIGUOUS_FIRST:
            return ()
        import torch  # here: the catalog, read by commands that never import torch, holds a Card

        x = args[0] if args else kwargs.get("self")
        if name in CONTIGUOUS_FIRST:
            if not isinstance(x, torch.Tensor) or x.is_contiguous():
                return ()
            return (x.numel() * x.element_size(),)
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.numel() >= 2**31:
            return ()
        dims = _dims(func, args, kwargs)
        return reduction_scratch(
            tuple(x.shape),
            tuple(x.stride()),
            x.storage_offset(),
            dims,
            _accumulator_bytes(name, x),
            self.card,
        )


def _dims(func, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
    dims = bound_arguments(func, args, kwargs).get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        return None
    return tuple(dims) if isinstance(dims, (list, tuple)) else (int(dims),)
