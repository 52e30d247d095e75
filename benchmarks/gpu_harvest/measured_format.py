"""The ``vramplan.measured/1`` file: what one GPU + software stack was measured to use
outside the tensors a step allocates. Pure Python (no torch), so it can move into
``src/vramplan`` as it is.

One file per GPU and stack, ``<gpu-slug>-<stack-slug>.json``, e.g.
``nvidia-h100-80gb-hbm3-torch2.14-cu12.8-cudnn9.10.json``::

    {
      "schema": "vramplan.measured/1",
      "gpu": "NVIDIA H100 80GB HBM3",            # as NVIDIA reports it
      "compute_capability": "9.0",
      "stack": {"torch": "2.14.1", "cuda": "12.8", "cudnn": "9.10.2", "driver": "570.86"},
      "floor": {"lazy": {"init": 531628032, "gemm": ...}, "eager": {...}},  # bytes outside
                                                  # the caching allocator, per stage
      "nvml": {"v1_used_idle": ..., "v2_used_idle": ..., "driver_reserved_bytes": ...,
               "total_bytes": ...},                # null where NVML could not say
      "cublas": {"cublas_workspace_bytes": 33554432, "cublaslt_workspace_bytes": 1048576,
                 "per_handle": {"default_stream_fp32": 34603008, ...}},
      "conv_workspaces": [
        {"pass": "forward", "dtype": "float32", "memory_format": "contiguous",
         "input": [32, 3, 224, 224], "weight": [64, 3, 7, 7], "stride": [2, 2],
         "padding": [3, 3], "dilation": [1, 1], "groups": 1, "benchmark": false,
         "workspace_bytes": 0, "reserved_growth_bytes": 0, "cache_emptied": false,
         "cached_workspace_bytes": 0}
      ]
    }

Each conv record is the FIRST call of a configuration in a fresh process:
``workspace_bytes`` is the largest allocation the call made and freed before returning (the
size cuDNN requested; with ``benchmark=True`` that is the search's largest candidate
workspace); ``reserved_growth_bytes`` is the peak of ``memory_reserved()`` during the call
minus its value before; ``cache_emptied`` says the call released cached segments
(``benchmark=True`` empties the cache after its search). The optional
``cached_workspace_bytes`` is the second, cached call's workspace (every later iteration).

    >>> slug("NVIDIA H100 80GB HBM3")
    'nvidia-h100-80gb-hbm3'
    >>> stack_slug("2.14.1+cu130", "12.8", 91002)
    'torch2.14-cu12.8-cudnn9.10'
"""

from __future__ import annotations

import json
import re
from pathlib import Path

SCHEMA = "vramplan.measured/1"
PASSES = ("forward", "backward_data", "backward_filter")

_TOP = {
    "schema": str,
    "gpu": str,
    "compute_capability": str,
    "stack": dict,
    "floor": dict,
    "nvml": dict,
    "cublas": dict,
    "conv_workspaces": list,
}
_STACK = ("torch", "cuda", "cudnn", "driver")
_NVML = ("v1_used_idle", "v2_used_idle", "driver_reserved_bytes", "total_bytes")
_CUBLAS = ("cublas_workspace_bytes", "cublaslt_workspace_bytes", "per_handle")
_CONV = {
    "pass": str,
    "dtype": str,
    "memory_format": str,
    "input": list,
    "weight": list,
    "stride": list,
    "padding": list,
    "dilation": list,
    "groups": int,
    "benchmark": bool,
    "workspace_bytes": int,
    "reserved_growth_bytes": int,
    "cache_emptied": bool,
}
_SHAPE_LENGTH = {"input": 2, "weight": 2, "stride": 0, "padding": 0, "dilation": 0}
"""Each shape's length past the spatial dimensions (2 for Conv2d, 3 for Conv3d)."""


def slug(text: str) -> str:
    """Lower case, runs of anything but letters, digits and dots become one ``-``."""
    return re.sub(r"[^a-z0-9.]+", "-", str(text).lower()).strip("-.")


def cudnn_text(version: int | str | None) -> str:
    """``torch.backends.cudnn.version()`` as text: 91002 -> '9.10.2', 8902 -> '8.9.2'."""
    if version in (None, ""):
        return ""
    if isinstance(version, str):
        return version
    if version >= 90000:  # cuDNN 9: major * 10000 + minor * 100 + patch
        return f"{version // 10000}.{version // 100 % 100}.{version % 100}"
    return f"{version // 1000}.{version // 100 % 10}.{version % 100}"


def _major_minor(version: str) -> str:
    return ".".join(re.split(r"[.+]", str(version))[:2])


def stack_slug(torch_version: str, cuda: str, cudnn: int | str | None) -> str:
    """``torch2.14-cu12.8-cudnn9.10`` from the versions PyTorch reports."""
    return (
        f"torch{_major_minor(torch_version)}-cu{_major_minor(cuda or 'none')}"
        f"-cudnn{_major_minor(cudnn_text(cudnn) or 'none')}"
    )


def file_name(gpu: str, stack: dict) -> str:
    return f"{slug(gpu)}-{stack_slug(stack['torch'], stack['cuda'], stack['cudnn'])}.json"


def conv_key(record: dict) -> tuple:
    """A hashable key of one convolution case (everything but what was measured)."""
    return (
        record["pass"],
        record["dtype"],
        record["memory_format"],
        tuple(record["input"]),
        tuple(record["weight"]),
        tuple(record["stride"]),
        tuple(record["padding"]),
        tuple(record["dilation"]),
        int(record["groups"]),
        bool(record["benchmark"]),
    )


def _is(value, kind) -> bool:
    if kind is int:  # bool is an int in Python; a count is not a bool
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _bytes_or_none(value) -> bool:
    return value is None or (_is(value, int) and value >= 0)


def _problem(data) -> str | None:
    """What is wrong with a measured file's content, or None."""
    if not isinstance(data, dict):
        return "the top level is not an object"
    for key, kind in _TOP.items():
        if key not in data:
            return f"missing key {key!r}"
        if not _is(data[key], kind):
            return f"{key!r} should be a {kind.__name__}"
    if data["schema"] != SCHEMA:
        return f"schema is {data['schema']!r}, expected {SCHEMA!r}"
    for section, keys in (("stack", _STACK), ("nvml", _NVML), ("cublas", _CUBLAS)):
        for key in keys:
            if key not in data[section]:
                return f"missing key {section}.{key}"
    for key in _STACK:
        if not isinstance(data["stack"][key], str):
            return f"stack.{key} should be a str"
    for key in _NVML:
        if not _bytes_or_none(data["nvml"][key]):
            return f"nvml.{key} should be a byte count or null"
    for key in _CUBLAS[:2]:
        if not _bytes_or_none(data["cublas"][key]):
            return f"cublas.{key} should be a byte count or null"
    if not isinstance(data["cublas"]["per_handle"], dict):
        return "cublas.per_handle should be an object"
    for loading, stages in data["floor"].items():
        if not isinstance(stages, dict):
            return f"floor.{loading} should be an object of stage -> bytes"
        for stage, value in stages.items():
            if value is not None and not _is(value, int):
                return f"floor.{loading}.{stage} should be a byte count or null"
    for index, record in enumerate(data["conv_workspaces"]):
        where = f"conv_workspaces[{index}]"
        if not isinstance(record, dict):
            return f"{where} is not an object"
        for key, kind in _CONV.items():
            if key not in record:
                return f"{where} is missing key {key!r}"
            if not _is(record[key], kind):
                return f"{where}.{key} should be a {kind.__name__}"
        if record["pass"] not in PASSES:
            return f"{where}.pass is {record['pass']!r}, expected one of {', '.join(PASSES)}"
        spatial = len(record["stride"])
        for key, extra in _SHAPE_LENGTH.items():
            value, length = record[key], spatial + extra
            if spatial not in (2, 3) or len(value) != length or not all(_is(v, int) for v in value):
                return f"{where}.{key} should be {length} integers (2-d or 3-d convolutions)"
        if record["workspace_bytes"] < 0:
            return f"{where}.workspace_bytes is negative"
        if not _bytes_or_none(record.get("cached_workspace_bytes")):
            return f"{where}.cached_workspace_bytes should be a byte count or null"
    return None


def validate(data: dict, source: str = "measured data") -> dict:
    """``data`` itself, or a one-line ValueError saying what is wrong with it."""
    problem = _problem(data)
    if problem:
        raise ValueError(f"{source}: {problem}")
    return data


def load_measured(path: str | Path) -> dict:
    """Read and validate a measured file (a one-line ValueError when it is malformed)."""
    file = Path(path)
    try:
        data = json.loads(file.read_text())
    except OSError as exc:
        raise ValueError(f"{file}: cannot read it ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file}: not JSON ({exc.msg} at line {exc.lineno})") from None
    return validate(data, str(file))


def merged(base: dict, new: dict) -> dict:
    """``new`` (a later harvest of the same card and stack), keeping the convolution
    records of ``base`` that it did not re-run.

    >>> old = {"conv_workspaces": [{"pass": "forward", "dtype": "float32",
    ...     "memory_format": "contiguous", "input": [1, 1, 4, 4], "weight": [1, 1, 3, 3],
    ...     "stride": [1, 1], "padding": [0, 0], "dilation": [1, 1], "groups": 1,
    ...     "benchmark": False, "workspace_bytes": 7}]}
    >>> again = {"conv_workspaces": [{**old["conv_workspaces"][0], "workspace_bytes": 9}]}
    >>> [r["workspace_bytes"] for r in merged(old, again)["conv_workspaces"]]
    [9]
    """
    records = {conv_key(r): r for r in base.get("conv_workspaces", [])}
    records.update({conv_key(r): r for r in new.get("conv_workspaces", [])})
    return {**new, "conv_workspaces": list(records.values())}


def write_measured(data: dict, folder: str | Path) -> Path:
    """Validate ``data`` and write it as ``folder/<gpu-slug>-<stack-slug>.json``."""
    validate(data)
    path = Path(folder) / file_name(data["gpu"], data["stack"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
