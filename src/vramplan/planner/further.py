"""Shardings that go further on the GPUs a run already has: from the user's layout, the
data-parallel shardings that hold less per rank at the same GPU count (more GPUs are not a
lever: buying them is the GPUs-needed answer's question)::

    further(ParallelLayout(shard="fsdp-grad-op", data_parallel=8))
    # [('FSDP full shard', ParallelLayout(shard='fsdp', data_parallel=8, ...), '--fsdp 8')]

>>> [flags for _, _, flags in further(ParallelLayout(shard="zero1", data_parallel=4))]
['--zero 2 --dp 4', '--zero 3 --dp 4']
>>> further(ParallelLayout(shard="fsdp", data_parallel=8))
[]
"""

from __future__ import annotations

from dataclasses import replace

from vramplan.distributed.layout import ParallelLayout

ZERO_STAGES = ("zero1", "zero2", "zero3")


def further(layout: ParallelLayout) -> list[tuple[str, ParallelLayout, str]]:
    """(name, layout, flags) of each sharding beyond ``layout`` on its GPUs: plain data
    parallelism or FSDP's grad-op → FSDP full shard (resharded after forward); a ZeRO stage
    → the higher stages; ZeRO-3 → the optimizer state offloaded, then the parameters. None
    on one GPU (a single card shards nothing)."""
    n = layout.data_parallel
    if n < 2:
        return []
    if layout.shard in ("none", "fsdp-grad-op"):
        full = replace(layout, shard="fsdp")
        version = " --fsdp-version 1" if layout.fsdp_version == 1 else ""
        return [("FSDP full shard", full, f"--fsdp {n}{version}")]
    if layout.shard in ZERO_STAGES[:2]:
        stages = ZERO_STAGES[ZERO_STAGES.index(layout.shard) + 1 :]
        return [
            (f"ZeRO-{stage[-1]}", replace(layout, shard=stage), f"--zero {stage[-1]} --dp {n}")
            for stage in stages
        ]
    if layout.shard == "zero3" and not layout.offload_optimizer:
        offloaded = replace(layout, offload_optimizer=True)
        return [("ZeRO-3 optimizer offload", offloaded, f"--zero 3 --dp {n} --offload-optimizer")]
    if layout.shard == "zero3" and not layout.offload_params:
        offloaded = replace(layout, offload_params=True)
        flags = f"--zero 3 --dp {n} --offload-optimizer --offload-params"
        return [("ZeRO-3 parameter offload", offloaded, flags)]
    return []
