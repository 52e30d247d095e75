"""What the CUDA runtime and libraries add to a step's memory, beside its tensors.

Two kinds of term: workspaces PyTorch's caching allocator serves (cuBLAS, cuBLASLt,
cuDNN), replayed with the trace; and memory outside the allocator (the CUDA context with
its loaded kernels, NCCL buffers), added to the device total. Figures and their sources
live in ``data/runtime.json``::

    >>> runtime_table()["cublas_workspace"]["sm90_bytes"]
    33554432
"""

from __future__ import annotations

from dataclasses import dataclass

from vramplan.device.catalog import GpuSpec, catalog
from vramplan.device.measured import MeasuredTable, floor_terms
from vramplan.device.profile import DeviceProfile
from vramplan.device.stack import Stack
from vramplan.device.table import runtime_table
from vramplan.ops import Library, library_of
from vramplan.result import Phase
from vramplan.trace.events import Trace


def uses_matmul(trace: Trace, phase: Phase) -> bool:
    """Whether any cuBLAS-backed op (``Library.MATMUL`` in the op registry) ran in ``phase``."""
    return any(p == phase and library_of(op) is Library.MATMUL for (p, op) in trace.op_counts)


CUDNN_OPS = ("_scaled_dot_product_cudnn_attention",)
"""Ops of the CUDA trace (backwards included, by prefix) that run in cuDNN beside
convolutions: SDPA's cuDNN kernel (``trace/cuda_sdpa.py``)."""
CUDNN_MODULES = ("LSTM", "GRU", "RNN")
"""Modules that run cuDNN on CUDA while the CPU trace records other ops: whole-sequence
recurrent modules (``aten/src/ATen/native/RNN.cpp``: ``use_cudnn`` ->
``at::cudnn_is_acceptable``; the trace records their cell decomposition,
``_thnn_fused_lstm_cell``, which the ``*Cell`` modules also run on CUDA without cuDNN).
Batch norm is left out: cuDNN's kernel needs a 3-d or larger input that is not bf16
(``_select_batch_norm_backend``), so a ``BatchNorm1d`` on features or one under amp-bf16
runs PyTorch's own, and a model with 2-d batch norm has convolutions."""


def uses_cudnn(trace: Trace) -> bool:
    """Whether the step calls cuDNN, which loads its kernels into the process: convolutions
    (each leaves a workspace marker), cuDNN attention (SDPA's first choice on sm90/sm100),
    or a module that runs cuDNN on CUDA (``CUDNN_MODULES``). On the
    H200 every bf16 transformer step with cuDNN attention and the LSTM step held the
    harvest's ``gemm_conv`` floor (758 MiB), 16 MiB above its ``gemm`` floor.

    >>> uses_cudnn(Trace((), (), 0, module_kinds={"rnn": "LSTM"}))
    True
    >>> uses_cudnn(Trace((), (), 0, op_counts={("forward", "_thnn_fused_lstm_cell"): 1}))
    False
    """
    return (
        bool(trace.markers)
        or any(op.startswith(CUDNN_OPS) for (_, op) in trace.op_counts)
        or any(kind in CUDNN_MODULES for kind in trace.module_kinds.values())
    )


def cublas_workspace_bytes(gpu: GpuSpec) -> int:
    table = runtime_table()["cublas_workspace"]
    if gpu.vendor == "amd":
        return table["rocm_bytes"]
    return table["sm90_bytes"] if gpu.arch == "sm90" else table["default_bytes"]


def cublaslt_workspace_bytes(gpu: GpuSpec) -> int:
    return 0 if gpu.vendor == "amd" else runtime_table()["cublaslt_workspace"]["bytes"]


COUNTERS = ("nvml-v1", "nvml-v2")


def driver_reserved_bytes(gpu: GpuSpec, measured: MeasuredTable | None = None) -> int:
    """The framebuffer the driver keeps for itself on ``gpu`` (measured when a harvest
    has it; 0 for AMD cards, whose tools report no such split, and for a card given by
    its size, ``--gpu-memory``, read as the memory the job can use)."""
    if measured is not None and "driver_reserved_bytes" in measured.nvml:
        return measured.nvml["driver_reserved_bytes"]
    if gpu.vendor == "amd" or gpu not in catalog():
        return 0
    table = runtime_table()["driver_reserved"]
    return table["by_gpu"].get(gpu.name, table["default_bytes"])


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


def _pick(values: list[int], variant: str) -> int:
    return values[{"low": 0, "central": 1, "high": 2}[variant]]


def outside_allocator(
    trace: Trace,
    gpu: GpuSpec,
    data_parallel: int = 1,
    profile: DeviceProfile | None = None,
    stack: Stack | None = None,
    variant: str = "central",
    measured: MeasuredTable | None = None,
) -> OutsideAllocator:
    """The CUDA context (with the kernels the step loads) and NCCL buffers, under the
    ``low`` / ``central`` / ``high`` reading of what is not published. A calibrated
    profile's measured context (kernels included, unless it says cuDNN was not loaded)
    and a measured table's floor stages replace the table's figures."""
    table = runtime_table()
    nccl = table["nccl"]["per_communicator_bytes"] if data_parallel > 1 else 0
    matmuls = uses_matmul(trace, Phase.FORWARD) or uses_matmul(trace, Phase.BACKWARD)
    cudnn_used = uses_cudnn(trace)
    images = table["kernel_images"]
    eager = stack is not None and not stack.lazy_loading
    # Eager loading loads a library's every kernel: its central reading takes the high
    # end, its high reading the largest eager cuBLAS image measured; the low end is kept.
    reading = "high" if eager and variant != "low" else variant
    measured_images = images["by_family"].get(gpu.family, {}) if reading == "central" else {}
    cublas = measured_images.get("cublas_bytes", _pick(images["cublas_range_bytes"], reading))
    cublas = cublas if matmuls else 0
    if eager and variant == "high" and matmuls:
        cublas = max(cublas, images["eager_cublas_high_bytes"])
    cudnn = measured_images.get("cudnn_bytes", _pick(images["cudnn_range_bytes"], reading))
    cudnn = cudnn if cudnn_used else 0
    if profile is not None:
        cudnn = cudnn if cudnn_used and not profile.cudnn_loaded else 0
        cublas = cublas if matmuls and not profile.cublas_loaded else 0
        return OutsideAllocator(profile.cuda_context_bytes, cublas, cudnn, nccl)
    context_table = table["cuda_context"]
    context = context_table["by_family"].get(gpu.family, context_table["default_bytes"])
    if eager:
        context = table["module_loading"]["eager_context_bytes"]
    elif variant != "central" and gpu.vendor == "nvidia":
        low, high = context_table["range_bytes"]
        context = min(context, low) if variant == "low" else max(context, high)
    # forward-only matmuls load fewer kernels; the high end keeps the whole GEMM stage
    # (the forward stage is fp32: a bf16 inference step may load other kernels)
    forward_only = variant != "high" and not uses_matmul(trace, Phase.BACKWARD)
    floor = floor_terms(measured.floor, not eager, forward_only) if measured is not None else {}
    if measured is not None and not measured.exact and variant != "central":
        # another PyTorch's table: its floor is the central reading, the model's the ends
        pick = min if variant == "low" else max
        modelled = {
            "cuda_context": context,
            "cublas_kernels": cublas,
            "cudnn_kernels": cudnn,
            "cudnn_beside_cublas": cudnn,
        }
        floor = {term: pick(value, modelled[term]) for term, value in floor.items()}
    # beside cuBLAS cuDNN adds less than alone (shared modules); the high end keeps what it
    # loads alone, as a step's other engines load more of it (H200 CNN steps: 758-762 MiB)
    beside = matmuls and variant != "high" and "cudnn_beside_cublas" in floor
    cudnn_term = "cudnn_beside_cublas" if beside else "cudnn_kernels"
    return OutsideAllocator(
        cuda_context=floor.get("cuda_context", context),
        cublas_kernels=floor.get("cublas_kernels", cublas) if matmuls else 0,
        cudnn_kernels=floor.get(cudnn_term, cudnn) if cudnn_used else 0,
        nccl=nccl,
    )
