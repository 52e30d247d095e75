"""What TensorFlow's runtime does to the card, beside what the step itself needs.

Sources (TensorFlow ``tensorflow/core/common_runtime/gpu/gpu_device.cc`` and the BFC
allocator, ``device/bfc.py``):

* **The memory limit** (``SingleVirtualDeviceMemoryLimit``): with no
  ``memory_limit`` (``tf.config.set_logical_device_configuration``) TensorFlow's allocator
  may use the memory free when the device is created less ``MinSystemMemory``: 225 MiB
  below 2 GiB free, else 500 MiB (compute capability ≤ 6), 1050 MiB (7.x), 1536 MiB (8.x),
  1800 MiB (9.x and later).
* **Preallocation**: without memory growth the BFC allocator's first region is the whole
  limit, so at the first tensor TensorFlow holds nearly all of the card whatever the step
  needs. ``tf.config.experimental.set_memory_growth`` (or ``TF_FORCE_GPU_ALLOW_GROWTH``)
  starts from 2 MiB and doubles each region: the card then shows what the job needs.
* **cuDNN scratch**: convolutions are autotuned by default (``TF_CUDNN_USE_AUTOTUNE``)
  with scratch up to ``TF_CUDNN_WORKSPACE_LIMIT_IN_MB``, 4 GiB by default
  (``GetDnnWorkspaceLimit(..., 1LL << 32)`` in ``conv_ops_gpu.cc``), taken from the BFC
  allocator without retry: scratch that does not fit is skipped, not an error.

What is emulated: the step's allocation sequence is the Keras/PyTorch trace (the torch
backend's kernels, not TensorFlow's), cuBLAS workspaces and the CUDA context are
PyTorch's figures for the card, and cuDNN scratch uses vramplan's engine model capped at
TensorFlow's limit.

>>> min_system_memory(40 * 2**30, 8) // 2**20, min_system_memory(2**30, 9) // 2**20
(1536, 225)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from vramplan.device.bfc import BfcResult, bfc_replay
from vramplan.device.options import DeviceOptions
from vramplan.device.replay import device_trace, requests_of
from vramplan.device.verdict import judge
from vramplan.result import Estimate
from vramplan.trace.events import Trace
from vramplan.units import format_bytes

MiB = 2**20
CUDNN_SCRATCH_LIMIT = 1 << 32
"""``TF_CUDNN_WORKSPACE_LIMIT_IN_MB``'s default (4 GiB; the code reads it in bytes)."""


EMULATED = (
    "TensorFlow emulated: the traced step's tensors replayed through TensorFlow's BFC "
    "allocator (bfc_allocator.cc) under its memory limit (gpu_device.cc); the CUDA context "
    "and cuBLAS workspaces are PyTorch's figures for this card, not TensorFlow's"
)
XLA = (
    "on the TensorFlow backend model.compile's default jit_compile='auto' compiles the "
    "train step with XLA on a GPU when every layer supports it (keras/src/trainers/"
    "trainer.py _resolve_auto_jit_compile); XLA fuses ops and assigns its own buffers, "
    "which this trace of the eager step (jit_compile=False) does not model"
)


def min_system_memory(available: int, cc_major: int) -> int:
    """``MinSystemMemory``: what TensorFlow leaves free of the memory free at start-up."""
    if available < 1 << 31:
        return 225 * MiB
    if cc_major <= 6:
        return 500 * MiB
    if cc_major <= 7:
        return 1050 * MiB
    if cc_major <= 8:
        return 1536 * MiB
    return 1800 * MiB


@dataclass(frozen=True)
class TensorflowMemory:
    """TensorFlow's view of one step on one card (bytes).

    ``needs_bytes``: the job's own need (runtime + the regions memory growth takes);
    ``takes_bytes``: what TensorFlow holds on the card under the chosen policy (what
    ``nvidia-smi`` shows); ``peak_bytes``: ``get_memory_info('GPU:0')['peak']``, the BFC
    allocator's peak of bytes in use."""

    policy: str
    memory_limit_bytes: int
    runtime_bytes: int
    peak_bytes: int
    needs_bytes: int
    takes_bytes: int
    fits: bool
    regions: int

    def to_json(self) -> dict:
        return asdict(self)

    def notes(self) -> list[str]:
        lines = [
            f"TensorFlow ({self.policy}): the step needs {format_bytes(self.needs_bytes)} "
            f"(BFC peak in use {format_bytes(self.peak_bytes)}, as get_memory_info reports it); "
            f"TensorFlow takes {format_bytes(self.takes_bytes)} of the card",
            EMULATED,
        ]
        if self.policy == "preallocate":
            lines.append(
                "TensorFlow preallocates its whole memory limit at the first tensor; on a "
                "shared card turn on tf.config.experimental.set_memory_growth "
                "(--tf-memory-growth) or set a limit (--tf-memory-limit)"
            )
        if not self.fits:
            lines.append(
                f"TensorFlow's allocator runs out within its limit of "
                f"{format_bytes(self.memory_limit_bytes)}"
            )
        return lines


def _requests(trace: Trace, options: DeviceOptions) -> list[tuple[int, int, bool, bool]]:
    """The step's requests as TensorFlow makes them: cuDNN scratch autotuned (the largest
    candidate under TensorFlow's limit), optional."""
    on_device = device_trace(trace, options.card, True, "central", options.measured)
    requests = []
    for request in requests_of(on_device):
        if request.empty_cache:
            continue
        size = request.size
        if request.candidates:
            size = max((c for c in request.candidates if c <= CUDNN_SCRATCH_LIMIT), default=0)
            if size == 0:
                continue
        requests.append((request.key, size, request.is_alloc, bool(request.candidates)))
    return requests


def tensorflow_memory(
    estimate: Estimate,
    trace: Trace,
    options: DeviceOptions,
    memory_growth: bool = False,
    memory_limit: int | None = None,
) -> TensorflowMemory:
    """Replay the step through TensorFlow's allocator under its default policy,
    ``memory_growth``, or a ``memory_limit`` in bytes (a logical device's limit)."""
    card = options.card
    peak = estimate.peak
    runtime = 0
    if peak.device_total_bytes is not None and peak.reserved_bytes is not None:
        runtime = peak.device_total_bytes - peak.reserved_bytes
    available = card.total_bytes - runtime
    limit = memory_limit
    if limit is None:
        system = min_system_memory(available, card.compute_capability[0])
        limit = available - system if system < available else available
    requests = _requests(trace, options)
    needed: BfcResult = bfc_replay(requests, limit=available, growth=True)
    used = needed if memory_growth else bfc_replay(requests, limit, False, available)
    if memory_growth and memory_limit is not None:
        used = bfc_replay(requests, limit, True, available)
    policy = "memory growth" if memory_growth else "preallocate"
    if memory_limit is not None:
        policy += f", limit {format_bytes(memory_limit)}"
    return TensorflowMemory(
        policy=policy,
        memory_limit_bytes=limit,
        runtime_bytes=runtime,
        peak_bytes=needed.peak_in_use_bytes,
        needs_bytes=runtime + needed.peak_pool_bytes,
        takes_bytes=runtime + used.peak_pool_bytes,
        fits=used.oom_at is None and needed.oom_at is None,
        regions=used.regions,
    )


def with_tensorflow(estimate: Estimate, memory: TensorflowMemory) -> Estimate:
    """The estimate with TensorFlow's figures in its notes and ``details["tensorflow"]``;
    the verdict judges the job's own need (memory growth's regions) and TensorFlow's
    allocator running out within its limit."""
    verdict = estimate.verdict
    if verdict is not None:
        verdict = judge(
            verdict.gpu,
            verdict.capacity_bytes,
            verdict.headroom,
            memory.needs_bytes,
            allocator_oom=not memory.fits,
        )
    keras = [XLA] if estimate.model.kind == "keras" else []
    return estimate.with_changes(
        verdict=verdict,
        notes=(*estimate.notes, *memory.notes(), *keras),
        details={**estimate.details, "tensorflow": memory.to_json()},
    )
