"""The device model: replay a trace through the caching allocator, add the runtime, and
judge the result against a card.

    est = apply_device(estimate, trace, device_options(gpu="a100-40gb"))
    est.peak.allocated_bytes <= est.peak.reserved_bytes <= est.peak.device_total_bytes
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

from vramplan.device.allocator import AllocatorConfig, Replay, Request, replay
from vramplan.device.catalog import GpuSpec
from vramplan.device.cudnn import ConvCase, Workspace, cases_of, engine_workspace
from vramplan.device.measured import MeasuredTable, measured_for
from vramplan.device.options import DeviceOptions
from vramplan.device.orders import legal_orders
from vramplan.device.runtime import (
    cublas_workspace_bytes,
    cublaslt_workspace_bytes,
    driver_reserved_bytes,
    outside_allocator,
    uses_matmul,
)
from vramplan.device.stack import default_stack, older_than_traced
from vramplan.device.verdict import judge
from vramplan.ops import Library, library_of
from vramplan.result import Component, Estimate, Phase
from vramplan.trace.events import Allocation, Event, PhaseMark, Trace
from vramplan.trace.summary import summarize_trace

SPREAD = 16  # trace indices are spread out so workspaces can be slotted between events
# (after an event: cuDNN's from +1, cuBLAS's at +12 and +13; before one: at -2 and -1)
VARIANTS = ("central", "low", "high")
WORKSPACE = "cudnn_workspace"
FIND = "cudnn_benchmark_find"
EMPTY_CACHE = "cudnn_empty_cache"


@dataclass(frozen=True)
class DeviceTrace:
    """A trace as the GPU runs it, with what the allocator replay needs beyond sizes: the
    candidate workspaces of cuDNN benchmark searches and the cache-emptying events."""

    trace: Trace
    candidates: dict[int, tuple[int, ...]] = field(default_factory=dict)
    empty_cache: frozenset[int] = frozenset()
    fallbacks: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """cuDNN without benchmark: the smaller workspaces of the next engines, tried when a
    call's own cannot be allocated on the card."""
    workspaces: dict[ConvCase, Workspace] = field(default_factory=dict)

    @cached_property
    def events(self) -> list[Event]:
        """``trace.events()``, listed once: the replay's requests and the step's other
        orders (``orders.py``) both walk them."""
        return list(self.trace.events())


def conv_workspace(
    case: ConvCase,
    benchmark: bool,
    measured: MeasuredTable | None = None,
    family: str | None = None,
) -> Workspace:
    """The workspace of one cuDNN call: the measured table's when it holds the
    configuration (the first call's size is the benchmark search's, the cached call's
    what every later call asks for), else the engine model's."""
    sizes = measured.workspace(case, benchmark) if measured is not None else None
    if sizes is None:
        return engine_workspace(case, family=family)
    first, cached = sizes
    spread = measured.spread(case, benchmark)
    if measured.exact and spread is None:
        return Workspace(cached, cached, cached, (first,), "measured", measured=True)
    if measured.exact:  # measured at other batches: either neighbour's engine, per image
        low, high = min(spread[0], cached), max(spread[1], cached)
        rule = "measured at other batches (affine; ends: their engines per image)"
        return Workspace(low, cached, high, (first,), rule, measured=True)
    model = engine_workspace(case, family=family)  # another PyTorch's table: its ends stay
    low, high = min(model.low, cached), max(model.high, cached)
    return Workspace(low, cached, high, (first,), "measured", measured=True)


def _spread(a: Allocation) -> Allocation:
    """``a`` at its indices times ``SPREAD`` (``dataclasses.replace`` costs seconds on a
    long trace)."""
    return Allocation(
        a.id,
        a.nbytes,
        a.category,
        a.phase,
        a.iteration,
        a.module,
        a.op,
        a.alloc_index * SPREAD,
        None if a.free_index is None else a.free_index * SPREAD,
        a.stream,
    )


def _first_index(trace: Trace, phase: Phase) -> int | None:
    mark = next((m for m in trace.phases if m.phase == phase), None)
    return None if mark is None else mark.index


def first_matmul_output(trace: Trace, phase: Phase, iteration: int) -> int | None:
    """The trace index of the first allocation a cuBLAS op makes in ``phase`` of
    ``iteration`` (None when none allocates). The handle's workspaces are created there,
    after the op's output: ``getCurrentCUDABlasHandle`` allocates a (handle, stream)'s
    workspace on its first call (``getNewWorkspace``, CublasHandlePool.cpp), and the
    cuBLASLt handle is the cuBLAS one (``getCurrentCUDABlasLtHandle``); an op such as
    ``addmm`` reaches them from its kernel, after its output is allocated. A first
    matmul late in the phase (VGG's classifier after the convolutions) so puts the
    workspaces in whatever cached block fits there, where they stay.

    >>> first_matmul_output(Trace((), (), 0), Phase.FORWARD, 1) is None
    True
    """
    indices = [
        a.alloc_index
        for a in trace.allocations
        if a.phase == phase and a.iteration == iteration and library_of(a.op) is Library.MATMUL
    ]
    return min(indices, default=None)


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


def device_trace(
    trace: Trace,
    gpu: GpuSpec,
    cudnn_benchmark: bool,
    variant: str = "central",
    measured: MeasuredTable | None = None,
) -> DeviceTrace:
    """The trace as the GPU sees it: cuBLAS/cuBLASLt workspaces created at the first matmul
    of forward and of backward (one handle per thread, kept), and around every cuDNN call
    (a forward; a backward's data and filter passes) its workspace, allocated and freed
    (``variant`` picks the low / central / high engine reading). With benchmark on, the
    first call of each configuration first times candidates with the largest workspace
    that fits, then empties the cache; later calls allocate the cached plan's size."""
    allocations = [_spread(a) for a in trace.allocations]
    next_id = max((a.id for a in trace.allocations), default=-1) + 1
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        start = _first_index(trace, phase)
        if start is None or not uses_matmul(trace, phase):
            continue
        iteration = trace.phase_at(start).iteration
        first = first_matmul_output(trace, phase, iteration)
        at = start * SPREAD - 2 if first is None else first * SPREAD + SPREAD - 4
        for slot, op, nbytes in (  # each its own slot: one index holds one event
            (at, "cublas_workspace", cublas_workspace_bytes(gpu)),
            (at + 1, "cublaslt_workspace", cublaslt_workspace_bytes(gpu)),
        ):
            if nbytes:
                allocations.append(_workspace(next_id, nbytes, slot, phase, iteration, op, None))
                next_id += 1
    candidates: dict[int, tuple[int, ...]] = {}
    fallbacks: dict[int, tuple[int, ...]] = {}
    empties: set[int] = set()
    workspaces: dict[ConvCase, Workspace] = {}
    for marker in trace.markers:
        slot = 0
        iteration = trace.phase_at(marker.index).iteration
        lags = marker.pass_lags or (0,) * len(marker.passes)
        for case, lag in zip(cases_of(marker), lags, strict=True):
            # after the gradient this pass writes (``OpMarker.pass_lags``), after the
            # previous pass's slots where both follow the same event
            slot = max(slot, (marker.index - lag) * SPREAD + 1)
            if case not in workspaces:
                workspace = conv_workspace(case, cudnn_benchmark, measured, gpu.family)
                if cudnn_benchmark:  # the search: time candidates, then emptyCache()
                    allocations.append(
                        _workspace(
                            next_id,
                            max(workspace.candidates),
                            slot,
                            marker.phase,
                            iteration,
                            FIND,
                            slot + 1,
                        )
                    )
                    candidates[next_id] = workspace.candidates
                    empties.add(next_id + 1)
                    allocations.append(
                        _workspace(
                            next_id + 1, 0, slot + 2, marker.phase, iteration, EMPTY_CACHE, None
                        )
                    )
                    next_id += 2
                    slot += 3
                workspaces[case] = workspace
            nbytes = workspaces[case].pick(variant)
            if nbytes:
                allocations.append(
                    _workspace(next_id, nbytes, slot, marker.phase, iteration, WORKSPACE, slot + 1)
                )
                if not cudnn_benchmark:
                    fallbacks[next_id] = workspaces[case].smaller_than(nbytes)
                next_id += 1
            slot += 2
    phases = tuple(
        PhaseMark(max(0, m.index * SPREAD - 2) if m.index else 0, m.phase, m.iteration)
        for m in trace.phases
    )
    on_device = replace(
        trace, allocations=tuple(allocations), phases=phases, event_count=trace.event_count * SPREAD
    )
    return DeviceTrace(
        on_device, candidates, frozenset(empties), fallbacks=fallbacks, workspaces=workspaces
    )


def requests_of(on_device: DeviceTrace | Trace) -> list[Request]:
    """The allocator requests of a (device) trace, in order."""
    if isinstance(on_device, Trace):
        on_device = DeviceTrace(on_device)
    empty, candidates, fallbacks = on_device.empty_cache, on_device.candidates, on_device.fallbacks
    requests = []
    for _, a, is_alloc in on_device.events:
        key = a.id
        if key in empty:
            requests.append(Request(key, 0, False, a.stream, True))
        elif is_alloc and (key in candidates or key in fallbacks):
            tried = candidates.get(key, ()), fallbacks.get(key, ())
            requests.append(Request(key, a.nbytes, True, a.stream, False, *tried))
        else:
            requests.append(Request(key, a.nbytes, is_alloc, a.stream))
    return requests


@dataclass(frozen=True)
class _Run:
    """One replay of the step under one reading of the unknowns."""

    on_device: DeviceTrace
    outside: object
    result: object
    requests: list[Request]
    """``requests_of(on_device)``, replayed again by ``order_excess`` and the capacity-limited
    replay."""
    replayed: Replay
    """The allocator as the step left it, which ``order_excess`` feeds more iterations."""

    @property
    def reserved(self) -> int:
        return self.result.stats.peak_reserved


def _replays(trace: Trace, options: DeviceOptions, config: AllocatorConfig, usable: int):
    """The central, low and high replays (the workspace replays are shared when no
    convolution's reading differs)."""
    gpu = options.card
    runs: dict[str, _Run] = {}
    for variant in VARIANTS:
        outside = outside_allocator(
            trace,
            gpu,
            options.data_parallel,
            options.profile,
            options.software,
            variant,
            options.measured,
        )
        central = runs.get("central")
        if central is not None and all(
            w.pick(variant) == w.central for w in central.on_device.workspaces.values()
        ):
            runs[variant] = replace(central, outside=outside)
            continue
        on_device = device_trace(trace, gpu, options.cudnn_benchmark, variant, options.measured)
        requests = requests_of(on_device)
        replayed = Replay(config, device_free=usable - outside.total)
        runs[variant] = _Run(on_device, outside, replayed.run(requests), requests, replayed)
    return runs


def order_excess(central: _Run, config: AllocatorConfig, usable: int, late_state: bool) -> int:
    """How far above the central replay's reserved peak the step's other legal orders
    reach (``device.orders``: more iterations, fed on to the central replay itself; with
    ``late_state``, the optimizer state created one step late), and the central order with
    each new segment placed below the earlier ones (the driver picks the addresses, which
    break ties between equal free blocks: ``CachingAllocator``): the high side of the
    fragmentation term, never below 0. Call it once per replay: it runs the central one on.
    """
    free = usable - central.outside.total
    orders = legal_orders(central.on_device, late_state)
    peaks = []
    if central.result.oom_at is None:  # (a replay that ran out of memory stopped there)
        peaks.append(central.replayed.run(orders.more_iterations).stats.peak_reserved)
    if orders.state_late:
        peaks.append(replay(orders.state_late, config, device_free=free).stats.peak_reserved)
    below = replay(central.requests, config, device_free=free, new_segments_below=True)
    peaks.append(below.stats.peak_reserved)
    return max([0, *(peak - central.reserved for peak in peaks)])


def _range(
    runs: dict[str, _Run], counted_reserve: int, order_high: int = 0
) -> tuple[list[int], list[int], dict]:
    """[low, high] of reserved and device total, and each unknown's share of the width."""
    central, low, high = runs["central"], runs["low"], runs["high"]
    reserved = [min(low.reserved, central.reserved), max(high.reserved, central.reserved)]
    outside = [
        min(low.outside.total, central.outside.total),
        max(high.outside.total, central.outside.total),
    ]
    packed = packed_reserved(low.result.stats.peak_allocated) - min(low.reserved, central.reserved)
    terms = {
        "cudnn_workspace": [reserved[0] - central.reserved, reserved[1] - central.reserved],
        "fragmentation": [min(0, packed), max(order_high, sensitivity(runs))],
        "floor": [outside[0] - central.outside.total, outside[1] - central.outside.total],
    }
    reserved[0] += terms["fragmentation"][0]
    reserved[1] += terms["fragmentation"][1]
    total = [reserved[0] + outside[0] + counted_reserve, reserved[1] + outside[1] + counted_reserve]
    widest = max(terms, key=lambda k: terms[k][1] - terms[k][0])
    if terms[widest][1] == terms[widest][0]:
        widest = ""
    return reserved, total, {"widest": widest, "terms": terms}


def sensitivity(runs: dict[str, _Run]) -> int:
    """How much less fragmentation (reserved less allocated peak) another workspace
    reading's replay ended with than the central one: segment packing answers small
    changes chaotically (a larger workspace can leave *less* reserved), so a change the
    model does not see may add as much. The high side of the fragmentation term, never
    below 0."""

    def waste(run: _Run) -> int:
        return run.reserved - run.result.stats.peak_allocated

    central = waste(runs["central"])
    return max(0, *(central - waste(run) for run in runs.values()))


def packed_reserved(peak_allocated: int) -> int:
    """The least the caching allocator can hold at a step's allocated peak: every live
    block packed into whole 2 MiB pages (segments never hold less than their blocks;
    expandable segments come nearest). The low end of the fragmentation term.

    >>> packed_reserved(3 * 2**20 + 1) // 2**20
    4
    """
    return -(-peak_allocated // PAGE) * PAGE


PAGE = 2 * 2**20

SETTLES = {
    "cudnn_workspace": "which cuDNN engines the convolutions pick (their workspaces)",
    "fragmentation": "how the caching allocator's segments pack the live blocks over many steps",
    "floor": "the CUDA context and the kernels cuBLAS/cuDNN load on this card and stack",
}


def apply_device(estimate: Estimate, trace: Trace, options: DeviceOptions) -> Estimate:
    """Fill the reserved peak, the device total (with its [low, high] range), the runtime
    terms and (with a GPU) the verdict, read at the high end. Allocated bytes and
    components become block sizes, as ``torch.cuda.max_memory_allocated`` counts them."""
    gpu = options.card
    config = AllocatorConfig.parse(options.alloc_conf)
    measured = options.measured
    if measured is None and options.gpu is not None:
        measured = measured_for(gpu.name, options.software.slug)
        options = replace(options, measured=measured)
    reserve = driver_reserved_bytes(gpu, measured)
    total = measured.nvml.get("total_bytes", gpu.total_bytes) if measured else gpu.total_bytes
    usable = total - reserve
    counted_reserve = reserve if options.used_counter == "nvml-v1" else 0

    runs = _replays(trace, options, config, usable)
    central = runs["central"]
    on_device, outside, unlimited = central.on_device, central.outside, central.result
    block_sizes = {  # as max_memory_allocated counts them
        a.id: unlimited.block_sizes.get(a.id, 0 if a.id in on_device.candidates else a.nbytes)
        for a in on_device.trace.allocations
    }
    summary = summarize_trace(on_device.trace, trace.module_kinds, on_device.events, block_sizes)
    stats = unlimited.stats
    job_total = stats.peak_reserved + outside.total
    # The reserved figure and the device total come from the same replay: the unlimited
    # one, or (when the card forces the allocator to free its cache and retry) the
    # capacity-limited one, so reserved never exceeds the device total.
    reserved, fragmentation = stats.peak_reserved, unlimited.fragmentation

    oom = False
    retries = 0
    if options.gpu is not None and job_total > usable:
        limited = replay(central.requests, config, capacity=usable - outside.total)
        oom = limited.oom_at is not None
        retries = limited.stats.num_alloc_retries
        if not oom:
            job_total = limited.stats.peak_reserved + outside.total
            reserved, fragmentation = limited.stats.peak_reserved, limited.fragmentation
    late_state = estimate.recipe.is_training and estimate.recipe.precision == "amp-fp16"
    order_high = order_excess(central, config, usable, late_state)
    reserved_range, total_range, widths = _range(runs, counted_reserve, order_high)
    reserved_range = [min(reserved_range[0], reserved), max(reserved_range[1], reserved)]
    total_range = [
        min(total_range[0], job_total + counted_reserve),
        max(total_range[1], job_total + counted_reserve),
    ]
    device_total = job_total + counted_reserve

    workspaces = {
        op: sum(a.nbytes for a in on_device.trace.allocations if a.op == op)
        for op in ("cublas_workspace", "cublaslt_workspace")
    }
    conv = [a.nbytes for a in on_device.trace.allocations if a.op == WORKSPACE]
    runtime = {
        **outside.to_json(),
        **workspaces,
        "cudnn_workspace_largest": max(conv, default=0),
        "driver_reserved": reserve,
    }
    notes = list(estimate.notes)
    if options.profile is not None:
        notes.append(
            f"runtime figures from the calibrated profile of {options.profile.gpu} "
            f"(driver {options.profile.driver}, CUDA {options.profile.cuda}, "
            f"torch {options.profile.torch})"
        )
    if measured is not None:
        card = measured.gpu if measured.sibling else gpu.name
        notes.append(f"measured figures for {card} on {measured.stack_slug}: {measured.path}")
        if measured.sibling:
            notes.append(
                f"no measured table for {gpu.name}: {measured.gpu}'s ({gpu.arch}, "
                f"{measured.stack_slug}) gives the central floor and cuDNN workspaces, "
                f"{gpu.name}'s own memory and driver reserve stay, the range keeps the model's "
                "readings; `python -m benchmarks.gpu_harvest` on this card makes its own"
            )
        elif not measured.exact:
            notes.append(
                f"no measured table for {options.software.slug} on {gpu.name}: the table of "
                f"{measured.stack_slug} (same card and CUDA) gives the central floor and cuDNN "
                "workspaces, the range keeps the model's readings; `python -m "
                "benchmarks.gpu_harvest` on this stack makes its own"
            )
    if options.gpu is None:
        notes.append(
            f"no --gpu given: reserved and device totals emulate an {gpu.name} ({gpu.arch}) runtime"
        )
    stack = options.software
    if older_than_traced(stack):
        notes.append(
            f"stack {stack.slug} is older than the PyTorch traced ({default_stack().slug}): "
            "its zero_grad, optimizer and module-loading defaults and autograd's saving "
            "rules (mul/div before 1.1, softmax before 1.11) are modelled, other "
            "operator changes between them are not in the range"
        )
    notes.append(
        f"device total as {options.used_counter} 'used' counts it "
        + (
            f"(driver reserve {reserve // 2**20} MiB included)"
            if counted_reserve
            else "(driver reserve excluded)"
        )
        + f"; stack {stack.slug}, {'lazy' if stack.lazy_loading else 'eager'} module loading"
    )
    cases = central.on_device.workspaces
    if cases:
        from_table = sum(1 for w in cases.values() if w.measured)
        notes.append(
            f"cuDNN workspaces per call from an engine model ({len(cases)} configurations"
            + (f", {from_table} measured" if from_table else "")
            + "; benchmark "
            + ("on" if options.cudnn_benchmark else "off")
            + "): `vramplan calibrate` or a measured table narrows it"
        )
        if options.cudnn_benchmark and from_table < len(cases):
            notes.append(
                "benchmark on: each configuration's first call also times every candidate "
                "engine with one workspace of the largest that fits in free memory; the "
                "model's candidates are Winograd, FFT and im2col, but measured searches took "
                "far more (on an H200, ResNet-50 at batch 32 peaked at 7.3 GiB allocated with "
                "benchmark on, 3.0 GiB with it off), so the first step's max_memory_allocated "
                "may read well above this figure; it cannot cause an OOM (candidates that do "
                "not fit are skipped) and the cache is emptied after each search"
            )
    if retries and not oom:
        notes.append(
            f"fits only after the allocator frees its cache and retries ({retries}x): "
            "expect slow steps"
        )
    peak = replace(
        summary.peak,
        reserved_bytes=reserved,
        device_total_bytes=device_total,
        fragmentation_bytes=fragmentation,
        reserved_range_bytes=(reserved_range[0], reserved_range[1]),
        device_total_range_bytes=(total_range[0], total_range[1]),
    )
    verdict = None
    if options.gpu:
        verdict = judge(
            gpu.name,
            usable,
            options.headroom,
            job_total,
            oom,
            high=total_range[1] - counted_reserve,
        )
        if verdict.status != "oom" and total_range[1] - counted_reserve > verdict.usable_bytes:
            above = max(widths["terms"], key=lambda k: widths["terms"][k][1])
            unknown = SETTLES.get(above if widths["terms"][above][1] else "", "the runtime terms")
            notes.append(
                f"the high end of the range passes the usable line; {unknown} would settle "
                "it: `vramplan calibrate` on the card narrows the range"
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
            "range": widths,
            "used_counter": options.used_counter,
            "stack": stack.slug,
            "usable_capacity_bytes": usable,
            "measured_table": measured.path if measured else "",
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
        verdict=verdict,
        notes=tuple(notes),
        details=details,
    )
