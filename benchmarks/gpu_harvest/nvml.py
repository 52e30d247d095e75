"""What NVML's "used" counts: v1 ``nvmlDeviceGetMemoryInfo`` (its used includes the
framebuffer the driver reserves), v2 (reports that reserve apart), per-process used memory,
and ``nvidia-smi``'s view. Reading needs ``pip install nvidia-ml-py`` and a GPU; the parsing
below is pure::

    >>> from types import SimpleNamespace as Mem
    >>> v1 = Mem(total=85_899_345_920, used=567_279_616, free=85_332_066_304)
    >>> v2 = Mem(total=85_899_345_920, used=4_194_304, free=85_332_066_304,
    ...          reserved=563_085_312)
    >>> memory_summary(v1, v2)["driver_reserved_bytes"]
    563085312
"""

from __future__ import annotations

import os
import subprocess

SMI_FIELDS = ("driver_version", "memory.used", "memory.total", "memory.reserved")


def _field(info, name: str) -> int | None:
    value = getattr(info, name, None) if info is not None else None
    return int(value) if isinstance(value, int) else None


def memory_summary(v1, v2) -> dict:
    """v1 and v2 memory-info objects (``.used/.total/.free``, v2 also ``.reserved``; either
    may be None) as one dict with the driver-reserved framebuffer: v1 used - v2 used, else
    v2's ``reserved``."""
    out = {
        "v1_used": _field(v1, "used"),
        "v1_total": _field(v1, "total"),
        "v1_free": _field(v1, "free"),
        "v2_used": _field(v2, "used"),
        "v2_total": _field(v2, "total"),
        "v2_free": _field(v2, "free"),
        "v2_reserved": _field(v2, "reserved"),
    }
    if out["v1_used"] is not None and out["v2_used"] is not None:
        out["driver_reserved_bytes"] = out["v1_used"] - out["v2_used"]
    else:
        out["driver_reserved_bytes"] = out["v2_reserved"]
    return out


def parse_smi(text: str, fields: tuple[str, ...]) -> list[dict]:
    """``nvidia-smi --query-gpu=... --format=csv,noheader,nounits`` output, one dict per GPU
    (MiB as nvidia-smi prints them; None for ``[N/A]`` or ``Not Supported``)."""
    rows = []
    for line in text.strip().splitlines():
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) != len(fields):
            continue
        row = {}
        for name, cell in zip(fields, cells, strict=True):
            try:
                row[name] = int(cell)
            except ValueError:
                row[name] = None if cell.startswith(("[", "Not")) else cell
        rows.append(row)
    return rows


def query_smi(index: int = 0) -> dict:
    """nvidia-smi's memory view of GPU ``index``, without ``memory.reserved`` when this
    nvidia-smi does not know that field."""
    for fields in (SMI_FIELDS, SMI_FIELDS[:3]):
        command = [
            "nvidia-smi",
            f"--id={index}",
            f"--query-gpu={','.join(fields)}",
            "--format=csv,noheader,nounits",
        ]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return {"error": f"nvidia-smi: {exc}"}
        if done.returncode == 0:
            rows = parse_smi(done.stdout, fields)
            return {
                "fields": list(fields),
                "unit": "MiB",
                "raw": done.stdout.strip(),
                **(rows[0] if rows else {}),
            }
        last = (done.stderr or done.stdout).strip().splitlines()
    return {"error": last[0] if last else "nvidia-smi failed"}


def _version_text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_nvml(index: int = 0, pid: int | None = None) -> dict:
    """NVML's memory counters for GPU ``index`` (and ``pid``'s used memory when NVML lists
    that process); ``{"error": ...}`` where NVML is missing."""
    try:
        import pynvml
    except ImportError:
        return {"error": "NVML unavailable: pip install nvidia-ml-py"}
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # no driver, no permission: the figures are simply unknown
        return {"error": f"nvmlInit: {exc}"}
    out: dict = {}
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        v1 = pynvml.nvmlDeviceGetMemoryInfo(handle)
        v2 = None
        version = getattr(pynvml, "nvmlMemory_v2", None)
        if version is None:
            out["v2_error"] = "this nvidia-ml-py has no nvmlMemory_v2"
        else:
            try:
                v2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=version)
            except Exception as exc:  # old driver or a binding that sets no version field
                out["v2_error"] = str(exc)
        out.update(memory_summary(v1, v2))
        out["driver"] = _version_text(pynvml.nvmlSystemGetDriverVersion())
        try:
            cuda = pynvml.nvmlSystemGetCudaDriverVersion()
            out["driver_cuda"] = f"{cuda // 1000}.{cuda % 1000 // 10}"
        except Exception:  # old NVML: the driver's CUDA version is optional
            pass
        processes = []
        try:
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                used = getattr(process, "usedGpuMemory", None)
                processes.append({"pid": int(process.pid), "used": used})
        except Exception as exc:
            out["processes_error"] = str(exc)
        out["processes"] = processes
        if pid is not None:
            mine = [p["used"] for p in processes if p["pid"] == pid and p["used"]]
            out["process_used"] = int(mine[0]) if mine else None
    except Exception as exc:
        out["error"] = f"NVML: {exc}"
    finally:
        pynvml.nvmlShutdown()
    return out


def visible_index() -> int:
    """NVML's index of the GPU CUDA calls device 0, when CUDA_VISIBLE_DEVICES names it by
    number (NVML ignores that variable); 0 otherwise."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(first) if first.isdigit() else 0
