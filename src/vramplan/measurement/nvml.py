"""NVML, read when ``nvidia-ml-py`` is installed: the memory this process holds on the GPU,
in which "used" counter, and the driver version::

    nvml_used()         # NvmlUsed(bytes=..., counter="nvml-v2", ...); None without NVML
    NvmlUsed(1000, "nvml-v2", driver_reserved_bytes=600).in_counter("nvml-v1")  # 1600
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NvmlUsed:
    """A used-memory reading and the counter it is in (``data/runtime.json`` used_counters):
    ``nvml-v2`` is this process's own memory (NVML's per-process list: context, kernels and
    the allocator's pool, no driver reserve); ``nvml-v1`` the device's used memory with the
    framebuffer the driver reserves (the fallback where NVML lists no processes, as in some
    containers). ``driver_reserved_bytes`` is NVML v2's ``reserved``, when the driver reports
    it (R510+)."""

    bytes: int
    counter: str
    driver_reserved_bytes: int | None = None

    def in_counter(self, counter: str) -> int | None:
        """The reading as ``counter`` would show it; None when the reserve is unknown."""
        if counter == self.counter:
            return self.bytes
        if self.driver_reserved_bytes is None:
            return None
        sign = 1 if counter == "nvml-v1" else -1
        return self.bytes + sign * self.driver_reserved_bytes


def _driver_reserved(pynvml, handle) -> int | None:
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2).reserved)
    except (AttributeError, TypeError, pynvml.NVMLError):  # an older driver or nvidia-ml-py
        return None


def nvml_used() -> NvmlUsed | None:
    """Memory this process holds on the current GPU, as NVML reports it."""
    try:
        import pynvml
    except ImportError:
        return None
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        reserve = _driver_reserved(pynvml, handle)
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if process.pid == os.getpid() and process.usedGpuMemory:
                return NvmlUsed(int(process.usedGpuMemory), "nvml-v2", reserve)
        return NvmlUsed(int(pynvml.nvmlDeviceGetMemoryInfo(handle).used), "nvml-v1", reserve)
    finally:
        pynvml.nvmlShutdown()


def nvml_used_bytes() -> int | None:
    """The bytes of ``nvml_used()``, in whichever counter NVML could give."""
    used = nvml_used()
    return used.bytes if used else None


def driver_version() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return str(pynvml.nvmlSystemGetDriverVersion())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVML missing or unusable: the version is simply unknown
        return ""
