"""``harvest.md``: the harvest as readable tables (pure)::

>>> mib(3 * 2**20)
'3.0'
>>> print(markdown({"device": {"name": "GPU"}, "stack": {}})[:9])
# GPU har
"""

from __future__ import annotations

import statistics


def mib(value) -> str:
    return "" if value is None else f"{value / 2**20:.1f}"


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join("" if c is None else str(c) for c in row) + " |" for row in rows]
    return [*lines, ""]


def _device(harvest: dict) -> list[str]:
    device, stack = harvest.get("device", {}), harvest.get("stack", {})
    rows = [
        ["GPU", device.get("name")],
        ["compute capability", device.get("compute_capability")],
        ["total memory (MiB)", mib(device.get("total_memory"))],
        *[[key, stack.get(key)] for key in ("driver", "cuda", "cudnn", "torch")],
        ["harvest seconds", harvest.get("seconds")],
    ]
    return ["## Device and stack", "", *_table(["", ""], rows)]


def _nvml(harvest: dict) -> list[str]:
    idle, smi = harvest.get("nvml_idle", {}), harvest.get("smi_idle", {})
    rows = [
        [f"NVML {key}", mib(idle.get(key))]
        for key in ("v1_used", "v1_total", "v2_used", "v2_total", "v2_reserved")
    ]
    rows.append(["driver reserved (v1 used - v2 used)", mib(idle.get("driver_reserved_bytes"))])
    for key in ("memory.used", "memory.total", "memory.reserved"):
        rows.append([f"nvidia-smi {key}", smi.get(key)])
    notes = [idle[k] for k in ("error", "v2_error") if idle.get(k)] + (
        [smi["error"]] if smi.get("error") else []
    )
    return [
        '## What "used" counts (idle GPU, before any CUDA process, MiB)',
        "",
        *_table(["counter", "MiB"], rows),
        *[f"- {note}" for note in notes],
        *([""] if notes else []),
    ]


def _floor(harvest: dict) -> list[str]:
    rows = []
    for loading, stages in harvest.get("floor", {}).items():
        for stage, child in stages.items():
            rows.append(
                [
                    loading,
                    stage,
                    mib(child.get("process_bytes")),
                    mib(child.get("reserved")),
                    mib(child.get("floor_bytes")),
                    mib(child.get("meminfo_used")),
                    child.get("source"),
                    child.get("seconds"),
                    child.get("error", ""),
                ]
            )
    header = ["loading", "stage", "process MiB", "reserved MiB", "floor MiB",
              "device used MiB", "source", "seconds", "error"]  # fmt: skip
    return ["## Process floor (outside the caching allocator)", "", *_table(header, rows)]


def _cublas(harvest: dict) -> list[str]:
    cublas = harvest.get("cublas", {})
    rows = [
        [
            case["case"],
            ", ".join(f"{w['bytes']:,} ({w['kind']})" for w in case["workspaces"]) or "none",
            f"{case['allocated_growth']:,}",
            case.get("oom") or "",
        ]
        for case in cublas.get("cases", [])
    ]
    lines = ["## cuBLAS / cuBLASLt workspaces (first call per handle and stream)", ""]
    if cublas.get("error"):
        lines += [f"- {cublas['error']}", ""]
    return lines + _table(["case", "workspaces left (bytes)", "allocated growth", "oom"], rows)


def _conv(harvest: dict) -> list[str]:
    conv = harvest.get("conv", {})
    records = [r for r in conv.get("records", []) if "pass" in r]
    lines = ["## cuDNN convolution workspaces", ""]
    for name, child in conv.get("children", {}).items():
        done = f"{child.get('cases_done')} of {child.get('cases_planned')} cases"
        lines.append(f"- {name}: {child.get('error') or done}")
    lines.append("")
    groups: dict[tuple, list[dict]] = {}
    for record in records:
        key = (record["benchmark"], record["call"], record["dtype"], record["pass"])
        groups.setdefault(key, []).append(record)
    rows = []
    for (benchmark, call, dtype, pass_name), group in sorted(groups.items()):
        ok = [r for r in group if not r.get("oom")]
        spaces = [r["workspace_bytes"] for r in ok] or [0]
        rows.append(
            [
                benchmark,
                call,
                dtype,
                pass_name,
                len(group),
                mib(statistics.median(spaces)),
                mib(max(spaces)),
                mib(max((r["reserved_growth_bytes"] for r in ok), default=0)),
                sum(r["cache_emptied"] for r in ok),
                len(group) - len(ok),
            ]
        )
    header = ["benchmark", "call", "dtype", "pass", "cases", "median ws MiB", "max ws MiB",
              "max reserved growth MiB", "cache emptied", "oom"]  # fmt: skip
    lines += _table(header, rows)
    top = sorted((r for r in records if not r.get("oom")), key=lambda r: -r["workspace_bytes"])
    rows = [
        [
            mib(r["workspace_bytes"]),
            r["pass"],
            r["dtype"],
            r["benchmark"],
            r["call"],
            "x".join(map(str, r["input"])),
            "x".join(map(str, r["weight"])),
            r["stride"][0],
            r["groups"],
            mib(r["reserved_growth_bytes"]),
        ]
        for r in top[:15]
    ]
    header = ["ws MiB", "pass", "dtype", "benchmark", "call", "input", "weight", "stride",
              "groups", "reserved growth MiB"]  # fmt: skip
    return [*lines, "### Largest workspaces", "", *_table(header, rows)]


FIGURES = ("allocated", "reserved", "device_total")


def _runs(harvest: dict) -> list[str]:
    lines = ["## Calibration and accuracy study", ""]
    calibrate = harvest.get("calibrate", {})
    lines.append(f"- calibrate: {calibrate.get('path') or calibrate.get('error') or 'not run'}")
    study = harvest.get("study", {})
    lines.append(f"- accuracy study: {study.get('csv') or study.get('error') or 'not run'}")
    lines.append("")
    rows = harvest.get("rows", [])
    if rows:
        lines += ["## Fresh-process measure rows (estimate on the card, its errors)", ""]
        lines += _table(
            ["row", "seconds", "allocated", "reserved", "device total", "error"],
            [
                [
                    row["name"],
                    row.get("seconds"),
                    *(_percent(row.get("errors", {}).get(f)) for f in FIGURES),
                    row.get("error", ""),
                ]
                for row in rows
            ],
        )
    return lines


def _percent(value) -> str:
    return "" if value is None else f"{value:+.1%}"


def markdown(harvest: dict) -> str:
    title = f"# GPU harvest: {harvest.get('device', {}).get('name', '?')}"
    parts = [title, ""]
    for section in (_device, _nvml, _floor, _cublas, _conv, _runs):
        try:
            parts += section(harvest)
        except (KeyError, TypeError, ValueError) as exc:  # a partial harvest still reports
            parts += [f"({section.__name__[1:]}: incomplete, {exc!r})", ""]
    return "\n".join(parts)
