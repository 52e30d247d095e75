"""How many GPUs of a kind a step needs, and with which sharding.

One trace at the per-GPU batch serves every candidate: sharding changes the model states
each rank holds, not the working set. Candidates go from the least communication to the
most (DDP, ZeRO-1, ZeRO-2, FSDP full shard, ZeRO-3, ZeRO-3 with optimizer offload) for
each power-of-two world size::

    answer = gpus_needed(estimate, facts)
    answer.gpus, answer.layout.describe()   # e.g. (8, 'fsdp dp=8')
"""

from __future__ import annotations

from dataclasses import dataclass

from vramplan.distributed.layout import ModelFacts, ParallelLayout, per_rank
from vramplan.errors import UserError
from vramplan.result import Estimate

MAX_GPUS = 1024
STRATEGIES = (
    ParallelLayout(shard="none"),
    ParallelLayout(shard="zero1"),
    ParallelLayout(shard="zero2"),
    ParallelLayout(shard="fsdp"),
    ParallelLayout(shard="zero3"),
    ParallelLayout(shard="zero3", offload_optimizer=True),
)


def host_state_bytes(rank: Estimate) -> int:
    """Host RAM a rank's layout offloads its model states to (0 without offload)."""
    return rank.details.get("parallel", {}).get("host_state_bytes", 0)


@dataclass(frozen=True)
class GpusNeeded:
    """The smallest data-parallel world size that fits, its layout and per-rank estimate."""

    gpus: int
    layout: ParallelLayout
    estimate: Estimate

    def to_json(self) -> dict:
        return {
            "gpus": self.gpus,
            "layout": self.layout.describe(),
            "per_rank_device_total_bytes": self.estimate.peak.device_total_bytes,
            "host_state_bytes": host_state_bytes(self.estimate),
            "status": self.estimate.verdict.status,
        }


def gpus_needed(
    estimate: Estimate, facts: ModelFacts, host_limit: int | None = None, start: int = 1
) -> GpusNeeded:
    """Search world sizes ``start``, 2 × ``start``, ... (1, 2, 4, ... by default) for the
    first layout whose every rank fits (and, with ``host_limit``, whose offloaded state
    fits the host's RAM); ``estimate`` is the single-GPU step's."""
    if estimate.verdict is None:
        raise UserError("counting GPUs needs a card: give --gpu NAME or --gpu-memory SIZE")
    gpus = start
    while gpus <= MAX_GPUS:
        for strategy in STRATEGIES:
            if gpus == 1 and strategy.shard != "none":
                continue
            layout = ParallelLayout(
                shard=strategy.shard,
                data_parallel=gpus,
                offload_optimizer=strategy.offload_optimizer,
            )
            rank = per_rank(estimate, layout, facts)
            if host_limit is not None and host_state_bytes(rank) > host_limit:
                continue
            if rank.verdict.status == "fits":
                return GpusNeeded(gpus, layout, rank)
        gpus *= 2
    raise UserError(
        f"no data-parallel layout up to {MAX_GPUS} GPUs fits {estimate.verdict.gpu}:"
        " the per-GPU working set alone is too large; lower the batch or sequence"
        " length, or add tensor/pipeline parallelism"
    )
