"""The cuDNN convolution path as PyTorch runs it, and the workspace each call asks for.

PyTorch (cuDNN v8 API, default since 2.0; ``aten/src/ATen/native/cudnn/Conv_v8.cpp``)
runs every convolution pass (forward, backward-data, backward-filter) as one cuDNN plan
and allocates that plan's workspace through the caching allocator on **every call**,
freeing it when the call returns. Which plan, and so how much workspace:

- ``cudnn.benchmark`` off (the default): the first plan of cuDNN's instant heuristic
  that runs; its workspace is **not capped** by free memory.
- ``cudnn.benchmark`` on: at the first call of each configuration, every candidate plan
  whose workspace fits ``max(device free, largest cached block)`` is timed with one
  workspace of the *largest* such size, then ``emptyCache()`` releases every cached free
  segment; the fastest plan is cached and later calls allocate its own workspace.

cuDNN publishes no workspace formulas, only which engines need "significant" workspace
(GEMM, FFT, FFT_TILING, WINOGRAD_NONFUSED), "some" (PRECOMP_GEMM) and none
(IMPLICIT_GEMM). So the size of each engine's workspace is a stated model
(``data/runtime.json`` ``cudnn_engines``), with a low / central / high per call::

    >>> case = ConvCase("forward", "float32", "contiguous", (128, 64, 224, 224),
    ...                 (64, 64, 3, 3), (1, 1), (1, 1), (1, 1), 1)
    >>> engine_workspace(case).rule.split(";")[0]
    'dense 3x3 stride 1: Winograd non-fused (central), implicit GEMM (low), FFT (high)'

A measured table (``device/measured.py``) replaces the model for the configurations it
holds. Sources: ../shared/research/cudnn-and-floor.md §1-2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vramplan.device.table import runtime_table

_ELEMENT = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


@dataclass(frozen=True)
class ConvCase:
    """One cuDNN call configuration (the plan cache's key, less pointer alignment)."""

    pass_: str
    dtype: str
    memory_format: str
    input: tuple[int, ...]
    weight: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    transposed: bool = False
    output_padding: tuple[int, ...] = ()
    """A transposed convolution's extra output rows and columns (none for others)."""

    @property
    def output_spatial(self) -> tuple[int, ...]:
        """The output's spatial sizes; a transposed convolution's grow with the stride.

        >>> ConvCase("forward", "float32", "contiguous", (8, 256, 14, 14), (256, 128, 2, 2),
        ...          (2, 2), (0, 0), (1, 1), 1, transposed=True).output_spatial
        (28, 28)
        """
        spatial = self.input[2:]
        kernel = self.weight[2:]
        extra = self.output_padding or (0,) * len(spatial)
        rows = zip(spatial, kernel, self.stride, self.padding, self.dilation, extra, strict=False)
        if self.transposed:
            return tuple((h - 1) * s - 2 * p + d * (r - 1) + e + 1 for h, r, s, p, d, e in rows)
        return tuple((h + 2 * p - d * (r - 1) - 1) // s + 1 for h, r, s, p, d, _ in rows)

    @property
    def output_channels(self) -> int:
        """The output's channels: the weight's first dimension, or for a transposed
        convolution its second times the groups."""
        return self.weight[1] * self.groups if self.transposed else self.weight[0]


@dataclass(frozen=True)
class Workspace:
    """The workspace a call asks for under the three readings of the engine choice, the
    candidates cuDNN's benchmark would time, and the rule (or measurement) used."""

    low: int
    central: int
    high: int
    candidates: tuple[int, ...]
    rule: str
    measured: bool = False

    def pick(self, variant: str) -> int:
        return {"low": self.low, "central": self.central, "high": self.high}[variant]

    def smaller_than(self, nbytes: int) -> tuple[int, ...]:
        """The readings below ``nbytes``, largest first: the engines cuDNN falls back to
        when a workspace of ``nbytes`` cannot be allocated.

        >>> Workspace(0, 2**20, 2**30, (), "model").smaller_than(2**30)
        (1048576, 0)
        """
        return tuple(sorted({s for s in (self.low, self.central) if s < nbytes}, reverse=True))


def cases_of(marker) -> list[ConvCase]:
    """The cuDNN calls one traced convolution op makes, in order (a backward runs its
    data pass, then its filter pass, each with its own workspace)."""
    if not marker.weight_shape or not marker.input_shape:
        return []
    return [
        ConvCase(
            pass_,
            marker.dtype,
            marker.memory_format,
            tuple(marker.input_shape),
            tuple(marker.weight_shape),
            tuple(marker.stride),
            tuple(marker.padding),
            tuple(marker.dilation),
            marker.groups,
            marker.transposed,
            tuple(marker.output_padding),
        )
        for pass_ in marker.passes
    ]


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _fft_bytes(case: ConvCase, element: int) -> int:
    """FFT engines: input, output and filters each transformed to a padded complex
    half-spectrum (cuFFT R2C); whole-image FFT up to 256 per side, 32x32 tiles
    (FFT_TILING) above that."""
    n, c = case.input[:2]
    k = case.output_channels
    kernel = case.weight[2:]
    padded = [h + 2 * p for h, p in zip(case.input[2:], case.padding, strict=False)]
    if max(padded, default=0) <= 256:
        sides = [_pow2(h) for h in padded]
        tiles = 1
    else:
        sides = [32] * len(padded)
        tiles = math.prod(
            math.ceil(o / max(1, 32 - r + 1))
            for o, r in zip(case.output_spatial, kernel, strict=False)
        )
    plane = math.prod(sides[:-1]) * (sides[-1] // 2 + 1) * 2 * max(element, 4) * tiles
    return plane * (n * c + n * k + k * (c // case.groups))


def engine_workspace(
    case: ConvCase, engines: dict | None = None, family: str | None = None
) -> Workspace:
    """The stated engine model (see the module docstring and ``runtime.json``); on a card
    of a ``layout_transform_families`` family the central reading is ``layout_transform``,
    on other cards it joins the high end.

    >>> case = ConvCase("forward", "float32", "contiguous", (32, 64, 56, 56),
    ...                 (64, 64, 3, 3), (1, 1), (1, 1), (1, 1), 1)
    >>> engine_workspace(case, family="Hopper").central == layout_transform(case)
    True
    """
    engines = engines or runtime_table()["cudnn_engines"]
    modelled = _engine_model(case, engines)
    central = layout_transform(case)
    if family not in engines["layout_transform_families"]:
        # the tensor-core engines measured on Hopper are a reading other families' stacks
        # may pick too (which engines a cuDNN version ranks first is not published)
        return Workspace(
            modelled.low,
            modelled.central,
            max(modelled.high, central),
            tuple(sorted({*modelled.candidates, central})),
            modelled.rule + "; high: NCHW <-> NHWC tensor-core copies if larger",
        )
    return Workspace(
        modelled.low,
        central,
        max(modelled.high, central),
        tuple(sorted({*modelled.candidates, central})),
        f"{family}: NCHW <-> NHWC copies for the tensor-core engines (central); " + modelled.rule,
    )


def layout_transform(case: ConvCase) -> int:
    """The workspace of a tensor-core engine run on NCHW tensors: cuDNN transforms them to
    NHWC (and the filter to KRSC) in its workspace, so input, output and filter are copied
    once; grouped/depthwise convolutions and 1x1 stride-1 forward / backward-data run
    layout-native GEMM-like kernels with none (``runtime.json`` cudnn_engines).

    >>> case = ConvCase("forward", "float32", "contiguous", (2, 3, 8, 8),
    ...                 (4, 3, 3, 3), (1, 1), (1, 1), (1, 1), 1)
    >>> layout_transform(case) == (2 * 3 * 64 + 2 * 4 * 64 + 4 * 3 * 9) * 4
    True
    """
    element = _ELEMENT.get(case.dtype, 4)
    unit = all(r == 1 for r in case.weight[2:]) and all(s == 1 for s in case.stride)
    native = case.pass_ in ("forward", "backward_data")
    if case.groups > 1 or (unit and native) or case.memory_format != "contiguous":
        return 0
    n, c = case.input[:2]
    x = n * c * math.prod(case.input[2:])
    y = n * case.output_channels * math.prod(case.output_spatial)
    return (x + y + math.prod(case.weight)) * element


def _engine_model(case: ConvCase, engines: dict) -> Workspace:
    element = _ELEMENT.get(case.dtype, 4)
    n, c = case.input[:2]
    k = case.output_channels
    kernel = case.weight[2:]
    out = case.output_spatial
    x = n * c * math.prod(case.input[2:]) * element
    y = n * k * math.prod(out) * element
    w = math.prod(case.weight) * element
    # PRECOMP_GEMM / GEMM "small": one image's column (im2col) buffer
    small = int(
        engines["small_images"] * (c // case.groups) * math.prod(kernel) * math.prod(out) * element
    )
    unit = all(r == 1 for r in kernel)
    stride1 = all(s == 1 for s in case.stride) and all(d == 1 for d in case.dilation)
    if case.groups > 1:
        return Workspace(0, 0, small, (0, small), "grouped/depthwise: implicit GEMM (~0)")
    if unit:
        return Workspace(0, 0, small, (0, small), "1x1: implicit GEMM (~0)")
    if stride1 and len(kernel) == 2 and tuple(kernel) == (3, 3) and not case.transposed:
        t = engines["winograd_tile_ratio"]
        winograd = int(t * (x + y) + engines["winograd_filter_ratio"] * w)
        fft = _fft_bytes(case, element)
        return Workspace(
            0,
            winograd,
            max(winograd, fft),
            (0, small, winograd, fft),
            "dense 3x3 stride 1: Winograd non-fused (central), implicit GEMM (low), FFT (high)",
        )
    if stride1 and not case.transposed:
        fft = _fft_bytes(case, element)
        return Workspace(
            0, small, max(small, fft), (0, small, fft), "dense stride 1: precomputed GEMM (small)"
        )
    return Workspace(0, small, small, (0, small), "strided/dilated/transposed: precomputed GEMM")
