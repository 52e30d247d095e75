"""Run the same step for real and measure it: on CUDA, PyTorch's allocator statistics and
the device's used memory (NVML); on the CPU, the peak of live tensor bytes from PyTorch's
profiler (its allocation events carry the CPU allocator's sizes) and the process RSS.

The real run builds the model from the same source with random (never downloaded)
weights and runs the loop the tracer runs (``steps.run_steps``)::

    m = measure_built(resolve("torchvision:resnet18", recipe), recipe, "cpu")
    m.allocated_bytes   # the peak of live tensor bytes in the real run
"""

from __future__ import annotations

import contextlib
import gc
import os
import resource
import time
from dataclasses import dataclass, field

import torch

from vramplan.collector import resume
from vramplan.device.catalog import GpuSpec, gpu_from_memory, lookup_gpu
from vramplan.errors import UserError
from vramplan.measurement.nvml import NvmlUsed, driver_version, nvml_used
from vramplan.native_stderr import quiet_native_stderr
from vramplan.optimizers import build_optimizer
from vramplan.recipe import Recipe
from vramplan.result import Phase
from vramplan.sources.base import BuiltModel
from vramplan.trace.loop import frees_gradients, run_steps
from vramplan.trace.materialize import materialize, unique_parameters
from vramplan.trace.policy import CpuPolicy, CudaPolicy
from vramplan.trace.step import prepare_model_for
from vramplan.trace.tricks import Offloader, step_in_backward


@dataclass(frozen=True)
class Measurement:
    """What a real run used. ``after_step_bytes`` is live tensor bytes after each step."""

    device: str
    steps: int
    allocated_bytes: int
    after_step_bytes: tuple[int, ...]
    reserved_bytes: int | None = None
    device_total_bytes: int | None = None
    rss_bytes: int | None = None
    oom: dict | None = None
    snapshot: str | None = None
    versions: dict = field(default_factory=dict)
    used: NvmlUsed | None = None
    """The NVML reading ``device_total_bytes`` came from, with its counter."""

    def device_total_in(self, counter: str) -> int | None:
        """The measured device total as ``counter`` (nvml-v1 / nvml-v2) shows it."""
        return self.used.in_counter(counter) if self.used else self.device_total_bytes

    def to_json(self) -> dict:
        data = {
            "device": self.device,
            "steps": self.steps,
            "allocated_bytes": self.allocated_bytes,
            "after_step_bytes": list(self.after_step_bytes),
        }
        for name in ("reserved_bytes", "device_total_bytes", "rss_bytes", "oom", "snapshot"):
            if getattr(self, name) is not None:
                data[name] = getattr(self, name)
        if self.used:
            data["used_counter"] = self.used.counter
            if self.used.driver_reserved_bytes is not None:
                data["driver_reserved_bytes"] = self.used.driver_reserved_bytes
        if self.versions:
            data["versions"] = self.versions
        return data


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _initialise(model: torch.nn.Module) -> None:
    """Random small values for a model that was built on the meta device."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_floating_point():
                tensor.uniform_(0.0, 0.02)


class _PhaseClock:
    """Remembers the phase the loop is in and when each step ended."""

    def __init__(self) -> None:
        self.phase, self.iteration = Phase.SETUP, 0
        self.step_ends: list[int] = []
        self.step_memory: list[int] = []

    def mark(self, phase: Phase, iteration: int, live: int | None = None) -> None:
        if phase == Phase.FORWARD and iteration > self.iteration and self.iteration > 0:
            self.step_ends.append(time.time_ns())
            if live is not None:
                self.step_memory.append(live)
        self.phase, self.iteration = phase, iteration


def _run(
    built: BuiltModel, recipe: Recipe, device: str, steps: int, clock: _PhaseClock, live: callable
) -> None:
    model = built.model
    policy = CudaPolicy() if device == "cuda" else CpuPolicy()
    with torch.device(device):
        if any(p.is_meta for p in model.parameters()):
            materialize(model, device)
            _initialise(model)
        params = unique_parameters(model)
        batch = built.make_batch(recipe.batch_size, getattr(torch, recipe.param_dtype_name))
    optimizer = None
    if recipe.is_training and recipe.optimizer_in_backward:
        step_in_backward(params, recipe.optimizer, policy.optimizer_defaults(), lr=0.0)
    elif recipe.is_training:
        optimizer = built.make_optimizer and built.make_optimizer(params, recipe)
        # learning rate 0: the same kernels and state, weights that cannot diverge
        optimizer = optimizer or build_optimizer(
            recipe.optimizer, params, policy.optimizer_defaults(), recipe.optimizer_impl, lr=0.0
        )

    offloader = Offloader(None, model) if recipe.activation_offload else None

    @contextlib.contextmanager
    def autocast():
        with contextlib.ExitStack() as stack:
            if recipe.uses_autocast:
                dtype = getattr(torch, recipe.compute_dtype_name)
                stack.enter_context(torch.autocast(device, dtype=dtype))
            if offloader is not None and recipe.is_training:
                stack.enter_context(offloader.forward())
            yield

    run_steps(
        built,
        model,
        batch,
        optimizer,
        recipe,
        set_to_none=frees_gradients(recipe, policy.frees_grads),
        autocast=autocast,
        iterations=steps,
        mark_phase=lambda phase, iteration: clock.mark(phase, iteration, live()),
    )
    clock.mark(Phase.FORWARD, steps + 1, live())


def local_card() -> GpuSpec:
    """The catalog card this machine's current CUDA device is, or one of its size."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    try:
        return lookup_gpu(props.name.replace("NVIDIA ", ""))
    except UserError:
        arch = (
            props.gcnArchName.split(":")[0]
            if torch.version.hip
            else (f"sm{props.major}{props.minor}")
        )
        return gpu_from_memory(f"{props.total_memory}B", arch=arch)


def check_device(device: str | None, steps: int = 1) -> str:
    """The device to measure on, validated (a UserError for a bad name or no GPU)."""
    device = device or default_device()
    if device not in ("cpu", "cuda"):
        raise UserError(f"unknown device {device!r}; choose cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("no CUDA device here: measure with --device cpu")
    if steps < 1:
        raise UserError(f"steps must be at least 1, got {steps}")
    return device


def measure_built(
    built: BuiltModel,
    recipe: Recipe,
    device: str | None = None,
    steps: int = 3,
    snapshot: str | None = None,
) -> Measurement:
    """Run ``steps`` real steps of ``built`` on ``device`` and measure them."""
    device = check_device(device, steps)
    resume()  # the collector runs in a measured step as in the user's
    prepare_model_for(built, recipe)  # dtype and checkpointing, before anything is measured
    if device == "cuda":
        return _measure_cuda(built, recipe, steps, snapshot)
    return _measure_cpu(built, recipe, steps)


def _allocation_events(prof) -> list[tuple[int, int]]:
    from torch._C._profiler import _EventType

    found = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            found.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    return sorted(found)


def cpu_peak_of(run: callable) -> tuple[int, list[tuple[int, int]]]:
    """Peak live tensor bytes while ``run()`` executes, from PyTorch's profiler, and the
    (time, live bytes) series."""
    from torch.profiler import ProfilerActivity, profile

    with (
        quiet_native_stderr(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        run()
    live = peak = 0
    series = []
    for stamp, size in _allocation_events(prof):
        live += size
        peak = max(peak, live)
        series.append((stamp, live))
    return peak, series


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of a real model's parameters and buffers (each storage once)."""
    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if not tensor.is_meta:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _measure_cpu(built: BuiltModel, recipe: Recipe, steps: int) -> Measurement:
    clock = _PhaseClock()
    oom = None
    # A model built for real already holds its weights when profiling starts.
    resident = resident_bytes(built.model)

    def run() -> None:
        nonlocal oom
        try:
            _run(built, recipe, "cpu", steps, clock, lambda: None)
        except RuntimeError as exc:  # the host ran out of memory: say where
            oom = {"phase": clock.phase, "step": clock.iteration, "error": str(exc)[:200]}

    peak, series = cpu_peak_of(run)
    after = []
    for end in clock.step_ends:
        before_end = [live for stamp, live in series if stamp <= end]
        after.append(resident + (before_end[-1] if before_end else 0))
    peak += resident
    gc.collect()
    return Measurement(
        device="cpu",
        steps=steps,
        allocated_bytes=peak,
        after_step_bytes=tuple(after),
        oom=oom,
        rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )


def _fresh_allocator(model: torch.nn.Module | None) -> None:
    """Start from what a training process that loads its weights in the run's dtype has: no
    cached copies of the weights (building on the card and casting, a config's bf16 to fp32
    to the recipe's dtype, leaves each earlier copy cached: 3292 MiB on the H200's TinyLlama
    row), no cuBLAS workspaces of an earlier measurement in this process (cuBLAS keeps one
    allocated block per handle and stream until ``_cuda_clearCublasWorkspaces``), and the
    peaks reset after both. A model built on the card is moved to the host and back first
    (``_parked_on_host``): its weights then sit in the allocator's segments as a load in the
    run's dtype puts them, one after another in module order, as the estimate's setup
    places them. The cast leaves them in segments sized for the earlier copies otherwise
    (on the H200, Qwen2.5-0.5B's bf16 weights in 18 MiB segments of fp32 weights and a
    260 MiB segment holding 20 MiB), and the step's blocks land elsewhere: replayed from
    the estimate's layout, that row's recorded requests reserve 22774 MiB, from the cast's
    18160."""
    gc.collect()
    torch._C._cuda_clearCublasWorkspaces()
    if model is not None and _parked_on_host(model):
        model.to("cpu")
        torch.cuda.empty_cache()
        model.to("cuda")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _parked_on_host(model: torch.nn.Module) -> bool:
    """Whether ``model`` has weights or buffers on a CUDA device and the host has them all
    twice over in free memory, so that ``_fresh_allocator`` may park them there."""
    tensors = [*model.parameters(), *model.buffers()]
    if not any(t.is_cuda for t in tensors):
        return False
    needed = sum(t.nbytes for t in {id(t): t for t in tensors}.values())
    return needed < os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2


def _measure_cuda(
    built: BuiltModel, recipe: Recipe, steps: int, snapshot: str | None
) -> Measurement:
    torch.cuda.init()
    _fresh_allocator(built.model)
    if snapshot:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    clock = _PhaseClock()
    oom = None
    try:
        _run(built, recipe, "cuda", steps, clock, torch.cuda.memory_allocated)
        torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError as exc:
        oom = {"phase": clock.phase, "step": clock.iteration, "error": str(exc).splitlines()[0]}
    allocated = torch.cuda.max_memory_allocated()
    reserved = torch.cuda.max_memory_reserved()
    used = nvml_used()
    if snapshot:
        torch.cuda.memory._dump_snapshot(snapshot)
        torch.cuda.memory._record_memory_history(enabled=None)
    built.model = None
    gc.collect()
    torch.cuda.empty_cache()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return Measurement(
        device=f"cuda:{props.name}",
        steps=steps,
        allocated_bytes=allocated,
        after_step_bytes=tuple(clock.step_memory),
        reserved_bytes=reserved,
        device_total_bytes=used.bytes if used else None,
        used=used,
        oom=oom,
        snapshot=snapshot,
        versions={
            "gpu": props.name,
            "total_memory": props.total_memory,
            "cuda": torch.version.cuda or "",
            "torch": torch.__version__,
            "driver": driver_version(),
        },
    )
