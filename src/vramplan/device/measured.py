"""Measured device tables: what a GPU harvest found on one card and software stack.

A file ``<gpu-slug>-<stack-slug>.json`` (schema ``vramplan.measured/1``) in
``$VRAMPLAN_MEASURED_DIR`` or the bundled ``data/measured/`` replaces the modelled
figures for that card and stack: the cuDNN workspace of each convolution configuration
it lists, the process floor, and the driver-reserved framebuffer::

    {"schema": "vramplan.measured/1", "gpu": "A100-40GB", "compute_capability": "8.0",
     "stack": {"torch": "2.5.1", "cuda": "12.4", "cudnn": "9.1.0", "driver": "550.54"},
     "floor": {"cuda_context": ..., "cublas_kernels": ..., "cudnn_kernels": ...},
     "nvml": {"v1_used_idle": ..., "v2_used_idle": ..., "driver_reserved_bytes": ...,
              "total_bytes": ...},
     "cublas": {...},
     "conv_workspaces": [{"pass": "forward", "dtype": "float32",
                          "memory_format": "contiguous", "input": [N, C, H, W],
                          "weight": [K, C/g, R, S], "stride": [1, 1], "padding": [1, 1],
                          "dilation": [1, 1], "groups": 1, "benchmark": false,
                          "workspace_bytes": ..., "reserved_growth_bytes": ...,
                          "cache_emptied": false}]}

``floor`` stages are the bytes each stage adds outside the allocator (the CUDA context,
then the kernels cuBLAS and cuDNN load); missing stages keep the model's figure.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

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
    workspaces: dict[tuple, int] = field(default_factory=dict)

    @property
    def stack_slug(self) -> str:
        return stack_slug(self.stack.get("torch", "?"), self.stack.get("cuda", "?"))

    def workspace(self, case: ConvCase, benchmark: bool) -> int | None:
        """The measured workspace of a configuration, if the harvest ran it."""
        return self.workspaces.get(_key(case, benchmark))


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
            workspaces[_key(case, bool(row.get("benchmark", False)))] = int(row["workspace_bytes"])
        return MeasuredTable(
            path=path,
            gpu=data["gpu"],
            stack=dict(data.get("stack", {})),
            floor={k: int(v) for k, v in data.get("floor", {}).items()},
            nvml={k: int(v) for k, v in data.get("nvml", {}).items() if v is not None},
            cublas=dict(data.get("cublas", {})),
            workspaces=workspaces,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"malformed measured table {path}: {exc}") from None


def _folders() -> list[Path]:
    folders = []
    if os.environ.get(MEASURED_DIR_ENV):
        folders.append(Path(os.environ[MEASURED_DIR_ENV]))
    folders.append(Path(str(resources.files("vramplan") / "data" / "measured")))
    return folders


def measured_for(gpu: str, stack: str) -> MeasuredTable | None:
    """The measured table of a card and stack (``$VRAMPLAN_MEASURED_DIR`` first, then the
    bundled ones), or ``None``."""
    name = f"{slug(gpu)}-{slug(stack)}.json"
    for folder in _folders():
        path = folder / name
        if path.is_file():
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise UserError(f"malformed measured table {path}: {exc}") from None
            table = parse_table(data, str(path))
            if slug(table.gpu) == slug(gpu) and table.stack_slug == slug(stack):
                return table
    return None
