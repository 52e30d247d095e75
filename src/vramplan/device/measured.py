"""Measured device tables: what a GPU harvest found on one card and software stack.

A file (schema ``vramplan.measured/1``, written by ``python -m benchmarks.gpu_harvest``)
in ``$VRAMPLAN_MEASURED_DIR`` or the bundled ``data/measured/`` replaces the modelled
figures for its card (the name NVIDIA reports, resolved through the catalog) and stack
(torch and CUDA, major.minor): the cuDNN workspace of each convolution configuration it
lists, the process floor, and the driver-reserved framebuffer::

    {"schema": "vramplan.measured/1", "gpu": "NVIDIA A100-SXM4-40GB",
     "compute_capability": "8.0",
     "stack": {"torch": "2.5.1", "cuda": "12.4", "cudnn": "9.1.0", "driver": "550.54"},
     "floor": {"lazy": {"init": ..., "gemm": ..., "conv": ..., "gemm_conv": ...},
               "eager": {...}},
     "nvml": {"v1_used_idle": ..., "v2_used_idle": ..., "driver_reserved_bytes": ...,
              "total_bytes": ...},
     "cublas": {...},
     "conv_workspaces": [{"pass": "forward", "dtype": "float32",
                          "memory_format": "contiguous", "input": [N, C, H, W],
                          "weight": [K, C/g, R, S], "stride": [1, 1], "padding": [1, 1],
                          "dilation": [1, 1], "groups": 1, "benchmark": false,
                          "workspace_bytes": ..., "reserved_growth_bytes": ...,
                          "cache_emptied": false}]}

``floor`` holds, per module-loading mode, the process's memory outside the allocator after
each harvest stage: ``init`` is the CUDA context, ``gemm`` − ``init`` the cuBLAS kernels,
``conv`` − ``init`` the cuDNN kernels (``floor_terms``); a stage the harvest could not run
keeps the model's figure.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

from vramplan.device.catalog import catalog, lookup_gpu
from vramplan.device.cudnn import ConvCase
from vramplan.device.stack import stack_slug
from vramplan.errors import UserError

MEASURED_DIR_ENV = "VRAMPLAN_MEASURED_DIR"
SCHEMA = "vramplan.measured/1"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


@dataclass(frozen=True)
class MeasuredTable:
    """One harvest's figures for a card and stack."""

    path: str
    gpu: str
    stack: dict
    floor: dict[str, int] = field(default_factory=dict)
    nvml: dict[str, int] = field(default_factory=dict)
    cublas: dict = field(default_factory=dict)
    workspaces: dict[tuple, tuple[int, int]] = field(default_factory=dict)
    """Per configuration: the first call's workspace (with benchmark on, the search's
    largest candidate) and the cached plan's, which every later call asks for."""
    batches: dict[tuple, list[tuple[int, tuple[int, int]]]] = field(default_factory=dict)
    """The same workspaces per configuration less its batch: (batch, workspaces), sorted."""
    exact: bool = True
    """False when the table was measured under another PyTorch on the same CUDA, or on a
    sibling card (``measured_for``): its figures are the central reading, the model's range
    stays."""
    sibling: bool = False
    """True when the table is another card's of the same architecture: its cuDNN engines
    and floor serve, its memory size and driver reserve do not (``nvml`` is emptied)."""

    @property
    def stack_slug(self) -> str:
        return stack_slug(self.stack.get("torch", "?"), self.stack.get("cuda", "?"))

    def workspace(self, case: ConvCase, benchmark: bool) -> tuple[int, int] | None:
        """(first call, cached calls) workspace of a configuration: the harvest's own, or at a
        batch it did not run, from the batches it ran (``between_batches``)."""
        exact = self.workspaces.get(_key(case, benchmark))
        if exact is not None:
            return exact
        points = self.batches.get(_unbatched(_key(case, benchmark)))
        return between_batches(points, int(case.input[0])) if points else None

    def spread(self, case: ConvCase, benchmark: bool) -> tuple[int, int] | None:
        """[low, high] of the cached-call workspace of a configuration measured only at
        other batches (``per_image_spread``); None when the harvest ran it as it is.

        >>> table = parse_table({"schema": SCHEMA, "gpu": "H200", "conv_workspaces": [
        ...     {"pass": "forward", "dtype": "float32", "input": [n, 8, 32, 32],
        ...      "weight": [8, 8, 3, 3], "stride": [1, 1], "padding": [1, 1],
        ...      "dilation": [1, 1], "groups": 1, "workspace_bytes": w}
        ...     for n, w in ((32, 100), (128, 800))]})
        >>> case = ConvCase("forward", "float32", "contiguous", (64, 8, 32, 32),
        ...                 (8, 8, 3, 3), (1, 1), (1, 1), (1, 1), 1)
        >>> table.workspace(case, False), table.spread(case, False)
        ((333, 333), (200, 400))
        """
        if _key(case, benchmark) in self.workspaces:
            return None
        points = self.batches.get(_unbatched(_key(case, benchmark)))
        return per_image_spread(points, int(case.input[0])) if points else None


def between_batches(points: list[tuple[int, tuple[int, int]]], batch: int) -> tuple[int, int]:
    """Workspaces at ``batch`` from those measured at other batches of one configuration:
    affine between the two nearest around it, proportional to the nearest beyond them. The
    engine cuDNN's heuristic picks holds per-image buffers, so its workspace grows with the
    batch (the H200 table's batch-128 workspaces are 2.8 to 4.0 times its batch-32 ones).

    >>> between_batches([(32, (100, 10)), (128, (400, 40))], 64)
    (200, 20)
    >>> between_batches([(32, (100, 10)), (128, (400, 40))], 256)
    (800, 80)
    """
    below = [p for p in points if p[0] <= batch]
    above = [p for p in points if p[0] >= batch]
    if below and above and below[-1][0] != above[0][0]:
        (n0, w0), (n1, w1) = below[-1], above[0]
        share = (batch - n0) / (n1 - n0)
        return tuple(round(a + (b - a) * share) for a, b in zip(w0, w1, strict=True))
    n, sizes = below[-1] if below else above[0]
    return tuple(round(size * batch / n) for size in sizes)


def per_image_spread(points: list[tuple[int, tuple[int, int]]], batch: int) -> tuple[int, int]:
    """The least and most cached-call workspace at ``batch`` if cuDNN's heuristic picks, at a
    batch the harvest did not run, the engine it picked at one of the batches it ran, with
    that engine's per-image buffers: each measured workspace scaled to ``batch``.

    >>> per_image_spread([(32, (100, 10)), (128, (400, 80))], 64)
    (20, 40)
    """
    scaled = [round(sizes[1] * batch / n) for n, sizes in points]
    return min(scaled), max(scaled)


def _unbatched(key: tuple) -> tuple:
    return (*key[:3], key[3][1:], *key[4:])


def _key(case: ConvCase, benchmark: bool) -> tuple:
    return (
        case.pass_,
        case.dtype,
        case.memory_format,
        tuple(case.input),
        tuple(case.weight),
        tuple(case.stride),
        tuple(case.padding),
        tuple(case.dilation),
        int(case.groups),
        bool(benchmark),
    )


def floor_terms(stages: dict, lazy: bool = True, forward_only: bool = False) -> dict[str, int]:
    """The runtime terms a harvest's staged floors give, for lazy or eager module loading;
    a step whose matmuls all run forward without autograd (inference) loads the kernels of
    the ``gemm_forward`` stage where the harvest ran it (lazy loading loads only the kernels
    a process calls: ResNet-50 inference on the H100 held 76 MiB of kernels beyond the
    context, a training step 148).

    The ``gemm_conv`` stage (both libraries) gives what cuDNN adds beside cuBLAS: on the
    H200 16 MiB, where cuDNN alone adds 20 (they share modules).

    >>> stages = {"lazy": {"init": 500, "gemm": 560, "gemm_forward": 520, "conv": 800}}
    >>> floor_terms(stages)
    {'cuda_context': 500, 'cublas_kernels': 60, 'cudnn_kernels': 300}
    >>> floor_terms(stages, forward_only=True)["cublas_kernels"]
    20
    >>> floor_terms({"lazy": {**stages["lazy"], "gemm_conv": 850}})["cudnn_beside_cublas"]
    290
    """
    staged = stages.get("lazy" if lazy else "eager") or {}
    init = staged.get("init")
    if init is None:
        return {}
    gemm = "gemm_forward" if forward_only and staged.get("gemm_forward") is not None else "gemm"
    terms = {"cuda_context": int(init)}
    for term, stage in (("cublas_kernels", gemm), ("cudnn_kernels", "conv")):
        if staged.get(stage) is not None:
            terms[term] = max(0, int(staged[stage]) - int(init))
    if staged.get("gemm_conv") is not None and staged.get("gemm") is not None:
        # the two libraries share some modules: what cuDNN adds once cuBLAS is loaded
        terms["cudnn_beside_cublas"] = max(0, int(staged["gemm_conv"]) - int(staged["gemm"]))
    return terms


def parse_table(data: dict, path: str = "<memory>") -> MeasuredTable:
    """A ``MeasuredTable`` from the JSON object of a file (a UserError when malformed)."""
    if data.get("schema") != SCHEMA:
        raise UserError(f"{path}: not a {SCHEMA} file")
    try:
        workspaces = {}
        for row in data.get("conv_workspaces", []):
            case = ConvCase(
                row["pass"],
                row["dtype"],
                row.get("memory_format", "contiguous"),
                tuple(row["input"]),
                tuple(row["weight"]),
                tuple(row["stride"]),
                tuple(row["padding"]),
                tuple(row["dilation"]),
                int(row["groups"]),
            )
            first = int(row["workspace_bytes"])
            cached = row.get("cached_workspace_bytes")
            workspaces[_key(case, bool(row.get("benchmark", False)))] = (
                first,
                first if cached is None else int(cached),
            )
        return MeasuredTable(
            path=path,
            gpu=data["gpu"],
            stack=dict(data.get("stack", {})),
            floor=dict(data.get("floor", {})),
            nvml={k: int(v) for k, v in data.get("nvml", {}).items() if v is not None},
            cublas=dict(data.get("cublas", {})),
            workspaces=workspaces,
            batches=_batches_of(workspaces),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"malformed measured table {path}: {exc}") from None


def _batches_of(workspaces: dict[tuple, tuple[int, int]]) -> dict[tuple, list]:
    """``MeasuredTable.batches``: each configuration's workspaces by batch, sorted."""
    batches: dict[tuple, list] = {}
    for key, sizes in workspaces.items():
        batches.setdefault(_unbatched(key), []).append((key[3][0], sizes))
    return {key: sorted(points) for key, points in batches.items()}


def with_sibling_records(own: MeasuredTable, siblings: list[MeasuredTable]) -> MeasuredTable:
    """``own`` with the convolution configurations and floor stages it lacks taken from
    sibling tables of the same stack (its own records win): the H100 SXM and H200 harvests
    measured the same workspace in 1559 of 1560 shared configurations and the same floor in
    every stage both ran, so a batch or stage one card's harvest ran and the other's did
    not is a measurement, not an interpolation, on both.

    >>> row = {"pass": "forward", "dtype": "float32", "weight": [8, 8, 3, 3],
    ...        "stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "groups": 1}
    >>> own = parse_table({"schema": SCHEMA, "gpu": "H100", "conv_workspaces": [
    ...     {**row, "input": [32, 8, 32, 32], "workspace_bytes": 100}]})
    >>> sibling = parse_table({"schema": SCHEMA, "gpu": "H200", "conv_workspaces": [
    ...     {**row, "input": [n, 8, 32, 32], "workspace_bytes": w}
    ...     for n, w in ((32, 7), (64, 250))]})
    >>> sorted(with_sibling_records(own, [sibling]).workspaces.values())
    [(100, 100), (250, 250)]
    """
    same_stack = [table for table in siblings if table.stack_slug == own.stack_slug]
    workspaces = {k: v for table in same_stack for k, v in table.workspaces.items()}
    workspaces.update(own.workspaces)
    floor = {loading: dict(stages) for loading, stages in own.floor.items()}
    for table in same_stack:
        for loading, stages in table.floor.items():
            floor[loading] = {**stages, **floor.get(loading, {})}
    if len(workspaces) == len(own.workspaces) and floor == own.floor:
        return own
    return replace(own, workspaces=workspaces, batches=_batches_of(workspaces), floor=floor)


def _folders() -> list[Path]:
    folders = []
    if os.environ.get(MEASURED_DIR_ENV):
        folders.append(Path(os.environ[MEASURED_DIR_ENV]))
    folders.append(Path(str(resources.files("vramplan") / "data" / "measured")))
    return folders


def _same_card(reported: str, gpu: str) -> bool:
    """Whether the name a harvest recorded is the catalog card ``gpu``."""
    try:
        return lookup_gpu(reported.replace("NVIDIA ", "")).name == gpu
    except UserError:
        return slug(reported) == slug(gpu)


@functools.cache
def _read(path: str, modified_ns: int) -> MeasuredTable | None:
    """The table in ``path`` (None for another schema's file), parsed once per version of
    the file: every estimate with a card looks its tables up."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"malformed measured table {path}: {exc}") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        return None
    return parse_table(data, path)


def _tables_of(gpu: str) -> list[MeasuredTable]:
    tables = []
    for folder in _folders():
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
            table = _read(str(path), path.stat().st_mtime_ns)
            if table is not None and _same_card(table.gpu, gpu):
                tables.append(table)
    return tables


def _sibling_tables(gpu: str) -> list[MeasuredTable]:
    """The tables of other catalog cards with ``gpu``'s architecture (``sm90``)."""
    try:
        arch = lookup_gpu(gpu).arch
    except UserError:
        return []
    names = {card.name for card in catalog() if card.arch == arch and card.name != gpu}
    return [table for name in sorted(names) for table in _tables_of(name)]


def torch_distance(slug_a: str, slug_b: str) -> tuple[int, int] | None:
    """How far apart two stacks' PyTorch releases are, when their CUDA is the same.

    >>> torch_distance("torch2.11-cu13.0", "torch2.14-cu13.0")
    (0, 3)
    >>> torch_distance("torch2.11-cu13.0", "torch2.11-cu12.8") is None
    True
    """
    torch_a, _, cuda_a = slug_a.partition("-")
    torch_b, _, cuda_b = slug_b.partition("-")
    if cuda_a != cuda_b:
        return None
    try:
        major_a, minor_a = (int(x) for x in torch_a.removeprefix("torch").split("."))
        major_b, minor_b = (int(x) for x in torch_b.removeprefix("torch").split("."))
    except ValueError:
        return None
    return abs(major_a - major_b), abs(minor_a - minor_b)


def _nearest(tables: list[MeasuredTable], stack: str) -> MeasuredTable | None:
    """The table of ``stack`` itself, else of the nearest PyTorch on its CUDA."""
    for table in tables:
        if table.stack_slug == slug(stack):
            return table
    near = [(d, t) for t in tables if (d := torch_distance(t.stack_slug, slug(stack)))]
    return min(near, key=lambda pair: pair[0])[1] if near else None


def measured_for(gpu: str, stack: str) -> MeasuredTable | None:
    """The measured table of a catalog card and a stack slug (``torch2.5-cu12.4``):
    ``$VRAMPLAN_MEASURED_DIR`` first, then the bundled tables. Without one for the stack,
    the table of the nearest PyTorch on the same card and CUDA, marked not ``exact``: the
    floor (context, kernel images) comes with the CUDA runtime and the driver, and the
    cuDNN workspaces with the engines cuDNN's heuristics pick on that card, which a
    PyTorch release with the same CUDA changes less than the engine model misses by (the
    H200 table's VGG-16 workspaces are 15-23% of the allocated peak below the model's).

    Without a table of the card, a sibling's: another card of the same architecture on the
    same CUDA, marked not ``exact`` and ``sibling``, without its memory size and reserve.
    The H100 SXM and H200 harvests (sm90, torch 2.11 + CUDA 13.0, cuDNN 9.19) measured the
    same workspace in 1559 of the 1560 benchmark-off convolution configurations both ran
    (the other 272 bytes apart) and the same floor: cuDNN's heuristics choose engines by
    compute capability and problem, not by memory size. For the same reason a card's own
    table takes the configurations and floor stages it lacks from its siblings' tables of
    the same stack (``with_sibling_records``). ``None`` when no card of the architecture has
    a table on that CUDA."""
    own = _nearest(_tables_of(gpu), stack)
    if own is not None:
        if own.stack_slug != slug(stack):
            return replace(own, exact=False)
        return with_sibling_records(own, _sibling_tables(gpu))
    siblings = _sibling_tables(gpu)
    sibling = _nearest(siblings, stack)
    if sibling is None:
        return None
    sibling = with_sibling_records(sibling, [t for t in siblings if t is not sibling])
    return replace(sibling, exact=False, sibling=True, nvml={})
