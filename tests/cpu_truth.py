"""Ground truth for the tracer: run the same step for real on the CPU and read the peak of
live tensor bytes from PyTorch's own profiler (its allocation events carry the CPU
allocator's running total)."""

from __future__ import annotations

import contextlib

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from vramplan.optimizers import build_optimizer
from vramplan.sources.base import BuiltModel
from vramplan.steps import run_steps
from vramplan.trace.materialize import materialize, unique_parameters
from vramplan.trace.policy import CpuPolicy
from vramplan.trace.step import prepare_model_for
from vramplan.workload import Recipe


def _allocation_events(prof) -> list[tuple[int, int]]:
    found = []

    def walk(nodes):
        for node in nodes:
            if node.tag == _EventType.Allocation:
                found.append((node.start_time_ns, node.extra_fields.alloc_size))
            walk(node.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    return sorted(found)


def real_cpu_peak(built: BuiltModel, recipe: Recipe) -> int:
    """Peak live tensor bytes of a real CPU run of the same steps the tracer runs."""
    prepare_model_for(built, recipe)
    model = built.model
    policy = CpuPolicy()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        materialize(model)  # real CPU tensors here: no fake mode is active; ties kept
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                if tensor.is_floating_point():
                    tensor.uniform_(0.0, 0.02)
        params = unique_parameters(model)
        batch = built.make_batch(recipe.batch_size, getattr(torch, recipe.param_dtype_name))
        optimizer = None
        if recipe.is_training:
            optimizer = build_optimizer(recipe.optimizer, params, policy.optimizer_defaults())
        run_steps(built, model, batch, optimizer, recipe,
                  autocast=lambda: policy.autocast(recipe) if recipe.uses_autocast
                  else contextlib.nullcontext(),
                  mark_phase=lambda phase, iteration: None)
        del batch, optimizer, params
    live = peak = 0
    for _, size in _allocation_events(prof):
        live += size
        peak = max(peak, live)
    return peak
