"""Turn a harvest (``harvest.json``'s content) into the ``vramplan.measured/1`` data the
device model reads (pure, no torch)::

    data = measured_from(json.load(open("harvest.json")))
    measured_format.write_measured(data, "src/vramplan/data/measured")

Convolution records: the first call of each case gives ``workspace_bytes``,
``reserved_growth_bytes`` and ``cache_emptied`` (what the first iteration does: with
``benchmark=True`` that is the search, its largest candidate workspace and the emptied
cache); the second, cached call's workspace is ``cached_workspace_bytes`` (what every
later iteration asks for). Cases that ran out of memory are left out.
"""

from __future__ import annotations

from benchmarks.gpu_harvest.cublas import summary as cublas_summary
from benchmarks.gpu_harvest.measured_format import SCHEMA, conv_key

CONV_FIELDS = ("input", "weight", "stride", "padding", "dilation", "groups")


def conv_records(raw: list[dict]) -> list[dict]:
    """Measured-file conv records from the harvest's per-call records."""
    first: dict[tuple, dict] = {}
    cached: dict[tuple, int | None] = {}
    for record in raw:
        if "pass" not in record:  # a case whose tensors did not fit
            continue
        entry = {
            "pass": record["pass"],
            "dtype": record["dtype"],
            "memory_format": record["memory_format"],
            **{field: record[field] for field in CONV_FIELDS},
            "benchmark": bool(record["benchmark"]),
            "workspace_bytes": int(record["workspace_bytes"]),
            "reserved_growth_bytes": max(0, int(record["reserved_growth_bytes"])),
            "cache_emptied": bool(record["cache_emptied"]),
        }
        key = conv_key(entry)
        if record.get("call", 1) == 1:
            if not record.get("oom"):
                first[key] = entry
        else:
            cached[key] = None if record.get("oom") else entry["workspace_bytes"]
    return [{**entry, "cached_workspace_bytes": cached.get(key)} for key, entry in first.items()]


def measured_from(harvest: dict) -> dict:
    device, stack, idle = harvest["device"], harvest["stack"], harvest.get("nvml_idle", {})
    floor = {
        loading: {stage: child.get("floor_bytes") for stage, child in stages.items()}
        for loading, stages in harvest.get("floor", {}).items()
    }
    return {
        "schema": SCHEMA,
        "gpu": device["name"],
        "compute_capability": device["compute_capability"],
        "stack": {key: str(stack.get(key) or "") for key in ("torch", "cuda", "cudnn", "driver")},
        "floor": floor,
        "nvml": {
            "v1_used_idle": idle.get("v1_used"),
            "v2_used_idle": idle.get("v2_used"),
            "driver_reserved_bytes": idle.get("driver_reserved_bytes"),
            "total_bytes": idle.get("v1_total") or device.get("total_memory"),
        },
        "cublas": cublas_summary(harvest.get("cublas", {})),
        "conv_workspaces": conv_records(harvest.get("conv", {}).get("records", [])),
    }
