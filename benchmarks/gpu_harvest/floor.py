"""The process floor: device memory a PyTorch process holds outside the caching allocator
(CUDA context, loaded kernel images, library handles), after each first use, under lazy and
eager module loading. Each stage runs in a fresh process with ``CUDA_MODULE_LOADING`` set
before CUDA starts::

    python -m benchmarks.gpu_harvest.floor gemm     # one stage, prints its figures

    >>> floor_figures({"process_used": 600 * 2**20, "reserved": 2**21}, idle_used=None)
    {'process_bytes': 629145600, 'source': 'nvml_process', 'floor_bytes': 627048448}
"""

from __future__ import annotations

import os
import sys
import time

STAGES = {
    "init": "torch.cuda.init() and a one-element tensor",
    "gemm": "init, then fp32 and bf16 matmul forward and backward",
    "gemm_forward": "init, then fp32 matmul and linear forward without autograd (inference)",
    "conv": "init, then fp32 and bf16 Conv2d forward and backward",
    "gemm_conv": "init, the GEMMs, then the convolutions (what a CNN training step loads)",
}
LOADINGS = ("lazy", "eager")


def floor_figures(child: dict, idle_used: int | None) -> dict:
    """The process's device memory and the part of it outside the allocator (the floor).
    NVML's per-process used memory when NVML lists the process; else the device-wide used
    memory from ``cudaMemGetInfo`` less what was used before the process started."""
    process = child.get("process_used")
    source = "nvml_process"
    if not process and child.get("meminfo_used") is not None:
        process = child["meminfo_used"] - (idle_used or 0)
        source = "mem_get_info" if idle_used is not None else "mem_get_info_no_baseline"
    if not process:
        return {"process_bytes": None, "source": None, "floor_bytes": None}
    return {
        "process_bytes": int(process),
        "source": source,
        "floor_bytes": int(process) - int(child.get("reserved") or 0),
    }


def _gemms(torch) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(256, 256, device="cuda", dtype=dtype, requires_grad=True)
        (a @ a).sum().backward()


def _forward_gemms(torch) -> None:
    with torch.no_grad():
        a = torch.randn(256, 256, device="cuda")
        torch.nn.functional.linear(a @ a, a, a[0])


def _convs(torch) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        conv = torch.nn.Conv2d(16, 16, 3, padding=1).to("cuda", dtype)
        x = torch.randn(4, 16, 32, 32, device="cuda", dtype=dtype, requires_grad=True)
        conv(x).sum().backward()


def run_stage(stage: str) -> dict:
    """Run ``stage`` in this (fresh) process and read every counter."""
    import torch

    from benchmarks.gpu_harvest.nvml import read_nvml, visible_index

    start = time.perf_counter()
    torch.cuda.init()
    torch.ones(1, device="cuda")
    if stage in ("gemm", "gemm_conv"):
        _gemms(torch)
    if stage == "gemm_forward":
        _forward_gemms(torch)
    if stage in ("conv", "gemm_conv"):
        _convs(torch)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    nvml = read_nvml(visible_index(), pid=os.getpid())
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "stage": stage,
        "module_loading": os.environ.get("CUDA_MODULE_LOADING", ""),
        "seconds": round(time.perf_counter() - start, 3),
        "meminfo_free": int(free),
        "meminfo_total": int(total),
        "meminfo_used": int(total - free),
        "reserved": int(torch.cuda.memory_reserved()),
        "allocated": int(torch.cuda.memory_allocated()),
        "process_used": nvml.get("process_used"),
        "nvml": nvml,
        "device": {
            "name": props.name,
            "compute_capability": f"{props.major}.{props.minor}",
            "total_memory": int(props.total_memory),
            "multi_processor_count": int(props.multi_processor_count),
        },
        "versions": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda or "",
            "cudnn": torch.backends.cudnn.version(),
            "driver": nvml.get("driver", ""),
        },
    }


def measure_floors(idle_used: int | None, stages=tuple(STAGES), timeout: float = 180) -> dict:
    """Every stage under every loading mode, each in a fresh process."""
    from benchmarks.gpu_harvest.child import run_child

    results: dict = {}
    for loading in LOADINGS:
        for stage in stages:
            env = {"CUDA_MODULE_LOADING": loading.upper()}
            child = run_child(["-m", "benchmarks.gpu_harvest.floor", stage], env, timeout)
            child.update(floor_figures(child, idle_used))
            results.setdefault(loading, {})[stage] = child
    return results


def main(argv: list[str]) -> int:
    from benchmarks.gpu_harvest.child import emit

    if len(argv) != 1 or argv[0] not in STAGES:
        print(
            f"usage: python -m benchmarks.gpu_harvest.floor {{{','.join(STAGES)}}}", file=sys.stderr
        )
        return 2
    emit(run_stage(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
