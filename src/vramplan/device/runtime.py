"""What the CUDA runtime and libraries add to a step's memory, beside its tensors.

Two kinds of term: workspaces PyTorch's caching allocator serves (cuBLAS, cuBLASLt,
cuDNN), replayed with the trace; and memory outside the allocator (the CUDA context with
its loaded kernels, NCCL buffers), added to the device total. Figures and their sources
live in ``data/runtime.json``::

    >>> runtime_table()["cublas_workspace"]["sm90_bytes"]
    33554432
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources

from vramplan.device.catalog import GpuSpec
from vramplan.device.profile import DeviceProfile
from vramplan.ops import Library, library_of
from vramplan.result import Phase
from vramplan.trace.events import Trace


@cache
def runtime_table() -> dict:
    """The bundled runtime figures with their sources."""
    return json.loads((resources.files("vramplan") / "data" / "runtime.json").read_text())


def uses_matmul(trace: Trace, phase: Phase) -> bool:
    """Whether any cuBLAS-backed op (``Library.MATMUL`` in the op registry) ran in ``phase``."""
    return any(p == phase and library_of(op) is Library.MATMUL for (p, op) in trace.op_counts)


def uses_convolution(trace: Trace) -> bool:
    return bool(trace.markers)


def cublas_workspace_bytes(gpu: GpuSpec) -> int:
    table = runtime_table()["cublas_workspace"]
    if gpu.vendor == "amd":
        return table["rocm_bytes"]
    return table["sm90_bytes"] if gpu.arch == "sm90" else table["default_bytes"]


def cublaslt_workspace_bytes(gpu: GpuSpec) -> int:
    return 0 if gpu.vendor == "amd" else runtime_table()["cublaslt_workspace"]["bytes"]


def conv_workspace_ratio(benchmark: bool) -> float:
    table = runtime_table()["cudnn_conv_workspace"]
    return table["benchmark_ratio" if benchmark else "heuristic_ratio"]


@dataclass(frozen=True)
class OutsideAllocator:
    """Device memory the caching allocator never sees."""

    cuda_context: int
    cublas_kernels: int
    cudnn_kernels: int
    nccl: int

    @property
    def total(self) -> int:
        return self.cuda_context + self.cublas_kernels + self.cudnn_kernels + self.nccl

    def to_json(self) -> dict[str, int]:
        return {
            "cuda_context": self.cuda_context,
            "cublas_kernels": self.cublas_kernels,
            "cudnn_kernels": self.cudnn_kernels,
            "nccl": self.nccl,
        }


def outside_allocator(
    trace: Trace, gpu: GpuSpec, data_parallel: int = 1, profile: DeviceProfile | None = None
) -> OutsideAllocator:
    """The CUDA context (with the kernels the step loads lazily) and NCCL buffers; a
    calibrated profile's measured context (kernels included) replaces the table's."""
    table = runtime_table()
    nccl = table["nccl"]["per_communicator_bytes"] if data_parallel > 1 else 0
    if profile is not None:
        return OutsideAllocator(profile.cuda_context_bytes, 0, 0, nccl)
    context = table["cuda_context"]["by_family"].get(
        gpu.family, table["cuda_context"]["default_bytes"]
    )
    matmuls = uses_matmul(trace, Phase.FORWARD) or uses_matmul(trace, Phase.BACKWARD)
    return OutsideAllocator(
        cuda_context=context,
        cublas_kernels=table["kernel_images"]["cublas_bytes"] if matmuls else 0,
        cudnn_kernels=table["kernel_images"]["cudnn_bytes"] if uses_convolution(trace) else 0,
        nccl=nccl,
    )
