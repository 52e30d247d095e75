"""DistributedDataParallel's gradient buckets on each rank, against PyTorch's own DDP.

A real DDP (gloo, one rank, on the CPU) reports the buckets its reducer allocated
(``_get_ddp_logging_data``) and PyTorch's profiler sees the allocation; the per-rank
estimate of plain data parallelism adds exactly that copy of the trainable gradients.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

from vramplan.distributed.facts import facts_of
from vramplan.distributed.layout import ParallelLayout, ddp_bucket_bytes, per_rank
from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe
from vramplan.sources.user_code import module_source

RECIPE = Recipe(batch_size=4, input_shape=(256,), optimizer="momentum")


def mlp() -> nn.Module:
    """Every size a multiple of 128 elements, so the allocator's 512-byte rounding of
    each gradient adds nothing; the first weight is frozen, as a backbone's first layers."""
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
    model[0].weight.requires_grad_(False)
    return model


def real_ddp_buckets() -> tuple[int, int]:
    """(the bucket bytes DDP reports, the bytes the profiler sees it allocate at the
    reducer's ``aten::empty``) for ``mlp()`` wrapped by a one-rank gloo DDP."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = mlp()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            ddp = nn.parallel.DistributedDataParallel(model)
        reported = ddp._get_ddp_logging_data()["bucket_sizes"]
        buckets = sum(int(size) for size in str(reported).split(","))
        empties = [e.cpu_memory_usage for e in prof.events() if e.name == "aten::empty"]
        return buckets, max(empties)
    finally:
        dist.destroy_process_group()


def test_ddp_per_rank_adds_the_reducers_bucket_copy_of_the_trainable_gradients():
    reported, allocated = real_ddp_buckets()
    trainable = sum(p.numel() * p.element_size() for p in mlp().parameters() if p.requires_grad)
    assert reported == allocated == trainable  # one bucket here, under the 1 MiB first cap

    built = module_source(mlp(), RECIPE, "mlp")
    single = estimate_built(built, RECIPE, target="cpu")
    rank = per_rank(single, ParallelLayout(data_parallel=8), facts_of(built))
    assert ddp_bucket_bytes(single, ParallelLayout(data_parallel=8)) == reported
    assert rank.peak.allocated_bytes - single.peak.allocated_bytes == reported
    assert rank.components["gradients"] == single.components["gradients"] + reported
    assert any("DDP" in note for note in rank.notes)
    # every phase as the single GPU holds it (a full replica; gradients that
    # zero_grad(set_to_none=True) frees stay freed), plus the buckets
    phases = single.details["phase_components"]
    for phase, total in rank.details["parallel"]["phase_peaks"].items():
        assert total == sum(phases[phase].values()) + reported


@pytest.mark.parametrize(
    "layout",
    [
        ParallelLayout(),
        ParallelLayout(shard="zero2", data_parallel=8),
        ParallelLayout(tensor_parallel=2),
    ],
)
def test_no_ddp_buckets_outside_plain_data_parallelism(layout):
    built = module_source(mlp(), RECIPE, "mlp")
    single = estimate_built(built, RECIPE, target="cpu")
    assert ddp_bucket_bytes(single, layout) == 0
