"""NVML, read when ``nvidia-ml-py`` is installed: the memory this process holds on the GPU
and the driver version::

    nvml_used_bytes()   # bytes this process holds on the GPU; None without NVML
"""

from __future__ import annotations

import os

import torch


def nvml_used_bytes() -> int | None:
    """Memory this process holds on the current GPU, as NVML reports it."""
    try:
        import pynvml
    except ImportError:
        return None
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if process.pid == os.getpid() and process.usedGpuMemory:
                return int(process.usedGpuMemory)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    finally:
        pynvml.nvmlShutdown()


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
