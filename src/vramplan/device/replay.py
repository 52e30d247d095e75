"""The device model: replay a trace through the caching allocator, add the runtime, and
judge the result against a card.

    est = apply_device(estimate, trace, device_options(gpu="a100-40gb"))
    est.peak.allocated_bytes <= est.peak.reserved_bytes <= est.peak.device_total_bytes
"""

from __future__ import annotations

from dataclasses import replace

from vramplan.device.allocator import AllocatorConfig, Request, replay
from vramplan.device.catalog import GpuSpec
from vramplan.device.options import DeviceOptions
from vramplan.device.runtime import (
    conv_workspace_ratio,
    cublas_workspace_bytes,
    cublaslt_workspace_bytes,
    outside_allocator,
    uses_matmul,
)
from vramplan.device.verdict import judge
from vramplan.result import Component, Estimate, Phase
from vramplan.trace.events import Allocation, PhaseMark, Trace
from vramplan.trace.summary import summarize_trace

SPREAD = 4  # trace indices are spread out so workspaces can be slotted between events


def _first_index(trace: Trace, phase: Phase) -> int | None:
    mark = next((m for m in trace.phases if m.phase == phase), None)
    return None if mark is None else mark.index


def _workspace(
    id_: int, nbytes: int, index: int, phase: Phase, iteration: int, op: str, free_index: int | None
) -> Allocation:
    return Allocation(
        id=id_,
        nbytes=nbytes,
        category=Component.TEMPORARIES,
        phase=phase,
        iteration=iteration,
        module="",
        op=op,
        alloc_index=index,
        free_index=free_index,
    )


def device_trace(trace: Trace, gpu: GpuSpec, cudnn_benchmark: bool) -> Trace:
    """The trace as the GPU sees it: cuBLAS/cuBLASLt workspaces created at the first matmul
    of forward and of backward (one handle per thread, kept), and a transient cuDNN
    workspace around every convolution."""
    allocations = [
        replace(
            a,
            alloc_index=a.alloc_index * SPREAD,
            free_index=None if a.free_index is None else a.free_index * SPREAD,
        )
        for a in trace.allocations
    ]
    next_id = max((a.id for a in trace.allocations), default=-1) + 1
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        start = _first_index(trace, phase)
        if start is None or not uses_matmul(trace, phase):
            continue
        iteration = trace.phase_at(start).iteration
        for op, nbytes in (
            ("cublas_workspace", cublas_workspace_bytes(gpu)),
            ("cublaslt_workspace", cublaslt_workspace_bytes(gpu)),
        ):
            if nbytes:
                allocations.append(
                    _workspace(next_id, nbytes, start * SPREAD - 1, phase, iteration, op, None)
                )
                next_id += 1
    ratio = conv_workspace_ratio(cudnn_benchmark)
    for marker in trace.markers:
        nbytes = int(ratio * max(marker.input_bytes, marker.output_bytes))
        if nbytes:
            index = marker.index * SPREAD + 1
            mark = trace.phase_at(marker.index)
            allocations.append(
                _workspace(
                    next_id,
                    nbytes,
                    index,
                    marker.phase,
                    mark.iteration,
                    "cudnn_workspace",
                    index + 1,
                )
            )
            next_id += 1
    phases = tuple(
        PhaseMark(max(0, m.index * SPREAD - 1) if m.index else 0, m.phase, m.iteration)
        for m in trace.phases
    )
    return replace(
        trace, allocations=tuple(allocations), phases=phases, event_count=trace.event_count * SPREAD
    )


def requests_of(trace: Trace) -> list[Request]:
    """The allocator requests of a trace, in order."""
    return [
        Request(e.allocation.id, e.allocation.nbytes, e.is_alloc, e.allocation.stream)
        for e in trace.events()
    ]


def apply_device(estimate: Estimate, trace: Trace, options: DeviceOptions) -> Estimate:
    """Fill the reserved peak, the device total, the runtime terms and (with a GPU) the
    verdict. Allocated bytes and components become block sizes, as
    ``torch.cuda.max_memory_allocated`` counts them."""
    gpu = options.card
    config = AllocatorConfig.parse(options.alloc_conf)
    on_device = device_trace(trace, gpu, options.cudnn_benchmark)
    requests = requests_of(on_device)
    unlimited = replay(requests, config)
    rounded = replace(
        on_device,
        allocations=tuple(
            replace(a, nbytes=unlimited.block_sizes.get(a.id, a.nbytes))
            for a in on_device.allocations
        ),
    )
    summary = summarize_trace(rounded, trace.module_kinds)
    outside = outside_allocator(trace, gpu, options.data_parallel, options.profile)
    stats = unlimited.stats
    device_total = stats.peak_reserved + outside.total

    oom = False
    retries = 0
    if options.gpu is not None and stats.peak_reserved + outside.total > gpu.total_bytes:
        limited = replay(requests, config, capacity=gpu.total_bytes - outside.total)
        oom = limited.oom_at is not None
        retries = limited.stats.num_alloc_retries
        if not oom:
            device_total = limited.stats.peak_reserved + outside.total

    workspaces = {
        op: sum(a.nbytes for a in on_device.allocations if a.op == op)
        for op in ("cublas_workspace", "cublaslt_workspace")
    }
    conv = [a.nbytes for a in on_device.allocations if a.op == "cudnn_workspace"]
    runtime = {**outside.to_json(), **workspaces, "cudnn_workspace_largest": max(conv, default=0)}
    notes = list(estimate.notes)
    if options.profile is not None:
        notes.append(
            f"runtime figures from the calibrated profile of {options.profile.gpu} "
            f"(driver {options.profile.driver}, CUDA {options.profile.cuda}, "
            f"torch {options.profile.torch})"
        )
    if options.gpu is None:
        notes.append(
            f"no --gpu given: reserved and device totals emulate an {gpu.name} ({gpu.arch}) runtime"
        )
    if conv:
        notes.append(
            "cuDNN convolution workspaces are a heuristic (a fraction of each "
            "convolution's tensors); calibrate on your GPU to replace it"
        )
    if retries:
        notes.append(
            f"fits only after the allocator frees its cache and retries ({retries}x): "
            "expect slow steps"
        )
    peak = replace(
        summary.peak,
        reserved_bytes=stats.peak_reserved,
        device_total_bytes=device_total,
        fragmentation_bytes=unlimited.fragmentation,
    )
    details = dict(estimate.details)
    details.update(
        {
            "gpu": gpu.to_json(),
            "alloc_conf": options.alloc_conf or "",
            "tensor_allocated_bytes": estimate.peak.allocated_bytes,
            "tensor_components": dict(estimate.components),
        "phase_components": summary.phase_components,
            "allocator": {
                "segments_allocated": stats.num_device_alloc,
                "reserved_at_allocated_peak": stats.reserved_at_peak_allocated,
                "allocated_at_reserved_peak": stats.allocated_at_peak_reserved,
                "alloc_retries": retries,
            },
        }
    )
    return replace(
        estimate,
        peak=peak,
        components=summary.components,
        phase_peaks=summary.phase_peaks,
        top_modules=summary.top_modules,
        timeline=summary.timeline,
        runtime=runtime,
        verdict=judge(gpu.name, gpu.total_bytes, options.headroom, device_total, oom)
        if options.gpu
        else None,
        notes=tuple(notes),
        details=details,
    )
