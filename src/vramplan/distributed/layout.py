"""Per-rank memory of a traced step under a parallel layout.

The single-GPU trace at the per-GPU batch gives the working set (activations,
temporaries, the input batch, the allocator's fragmentation); the layout decides the model
states each rank holds and how activations divide::

    layout = ParallelLayout(shard="zero3", data_parallel=8)
    est = per_rank(estimate, layout, model_facts)   # one rank's Estimate

>>> ParallelLayout(shard="zero3", data_parallel=8).describe()
'zero3 dp=8'
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vramplan.device.table import runtime_table
from vramplan.device.verdict import judge
from vramplan.distributed.zero import (
    bucket_bytes,
    zero1_model_states,
    zero2_model_states,
    zero3_model_states,
)
from vramplan.errors import UserError
from vramplan.result import Component, Estimate, Peak, Phase

SHARDS = ("none", "zero1", "zero2", "zero3", "fsdp", "fsdp-grad-op")
STATES = (Component.PARAMETERS, Component.GRADIENTS, Component.OPTIMIZER_STATE)


@dataclass(frozen=True)
class ModelFacts:
    """What the layout needs to know about the model."""

    parameters: int
    largest_block_parameters: int
    layers: int
    heads: int | None = None
    repeated: bool = True
    """Whether the blocks repeat one class (a transformer's layers), not just children."""
    root_parameters: int = 0
    """Parameters outside the repeated blocks (embeddings, head): FSDP2's root group,
    which stays gathered from forward to backward."""


@dataclass(frozen=True)
class ParallelLayout:
    """Data-parallel sharding, tensor and pipeline parallelism, offload."""

    shard: str = "none"
    data_parallel: int = 1
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    pipeline_parallel: int = 1
    microbatches: int = 1
    offload_optimizer: bool = False
    offload_params: bool = False
    fsdp_version: int = 2
    """PyTorch's FSDP2 (``fully_shard``) or FSDP1 (``FullyShardedDataParallel``), with
    ``shard="fsdp"`` or ``"fsdp-grad-op"`` (``distributed/fsdp.py``)."""

    def __post_init__(self) -> None:
        if self.shard not in SHARDS:
            raise UserError(f"unknown sharding {self.shard!r}; choose {', '.join(SHARDS)}")
        if self.fsdp_version not in (1, 2):
            raise UserError(f"--fsdp-version must be 1 or 2, got {self.fsdp_version}")
        if self.fsdp_version == 1 and not self.shard.startswith("fsdp"):
            raise UserError(
                "--fsdp-version 1 goes with FSDP sharding: --fsdp N, or --world-size N "
                "--shard full|grad-op"
            )
        for name in ("data_parallel", "tensor_parallel", "pipeline_parallel", "microbatches"):
            if getattr(self, name) < 1:
                raise UserError(f"{name.replace('_', ' ')} must be at least 1")
        if self.offload_params and self.shard != "zero3":
            raise UserError("parameter offload needs ZeRO stage 3 (--zero 3)")

    @property
    def world_size(self) -> int:
        return self.data_parallel * self.tensor_parallel * self.pipeline_parallel

    def describe(self) -> str:
        parts = [self.shard if self.shard != "none" else "ddp", f"dp={self.data_parallel}"]
        if self.fsdp_version == 1:
            parts.append("fsdp-version=1")
        if self.tensor_parallel > 1:
            parts.append(f"tp={self.tensor_parallel}" + ("+sp" if self.sequence_parallel else ""))
        if self.pipeline_parallel > 1:
            parts.append(f"pp={self.pipeline_parallel}x{self.microbatches}mb")
        if self.offload_optimizer:
            parts.append("offload-optimizer")
        if self.offload_params:
            parts.append("offload-params")
        return " ".join(parts)


def check_layout(layout: ParallelLayout, facts: ModelFacts) -> None:
    """Reject layouts the model cannot take (one clear line each)."""
    if layout.tensor_parallel > 1 and not facts.heads:
        raise UserError(
            f"--tp {layout.tensor_parallel}: tensor parallelism splits attention heads "
            "(Megatron); this model has none"
        )
    if layout.pipeline_parallel > 1 and not facts.repeated:
        raise UserError(
            f"--pp {layout.pipeline_parallel}: pipeline stages split repeated blocks; "
            "this model has none"
        )
    if facts.heads and facts.heads % layout.tensor_parallel:
        raise UserError(
            f"tensor parallel degree {layout.tensor_parallel} does not divide the "
            f"{facts.heads} attention heads"
        )
    if layout.pipeline_parallel > max(1, facts.layers):
        raise UserError(
            f"pipeline parallel degree {layout.pipeline_parallel} is larger than the "
            f"{facts.layers} layers"
        )


def _model_states(est: Estimate, layout: ParallelLayout, facts: ModelFacts) -> tuple[int, int]:
    """(per-GPU bytes, per-host bytes) of parameters, gradients and optimizer state."""
    psi = facts.parameters // (layout.tensor_parallel * layout.pipeline_parallel)
    largest = facts.largest_block_parameters // layout.tensor_parallel
    n = layout.data_parallel
    single = (
        est.components[Component.PARAMETERS]
        + est.components[Component.GRADIENTS]
        + est.components[Component.OPTIMIZER_STATE]
    ) // (layout.tensor_parallel * layout.pipeline_parallel)
    if layout.shard == "zero1":
        return zero1_model_states(psi, n).gpu_bytes, 0
    if layout.shard == "zero2":
        states = zero2_model_states(psi, gpus_per_node=n, cpu_offload=layout.offload_optimizer)
        return states.gpu_bytes, states.cpu_bytes
    if layout.shard == "zero3":
        states = zero3_model_states(
            psi,
            largest,
            gpus_per_node=n,
            cpu_offload=layout.offload_optimizer,
            cpu_offload_params=layout.offload_params,
        )
        return states.gpu_bytes, states.cpu_bytes
    per_param = single / max(1, psi)  # bytes per parameter in this recipe
    param_bytes = est.components[Component.PARAMETERS] / max(1, facts.parameters)
    gathered = 2 if est.recipe.uses_autocast else param_bytes  # FSDP2 gathers in half
    if layout.shard == "fsdp":
        # FSDP2 full shard: states / N, the root group gathered throughout, the current and
        # the prefetched block gathered, one block's gradients before reduce-scatter
        root = facts.root_parameters // layout.tensor_parallel
        return int(single / n + (root + 2 * largest) * gathered + largest * param_bytes), 0
    if layout.shard == "fsdp-grad-op":  # parameters stay gathered between forward and backward
        return int(psi * gathered + (single - psi * param_bytes) / n), 0
    return int(per_param * psi), 0


def _activation_share(layout: ParallelLayout) -> float:
    """Fraction of the single-GPU activations a rank keeps (Korthikanti et al. 2022: with
    tensor parallelism 10 of the 34 sbh stay replicated; sequence parallelism splits those
    too). Under 1F1B the first pipeline stage holds min(p, M) micro-batches of L/p layers."""
    t = layout.tensor_parallel
    share = 1.0 / t if layout.sequence_parallel or t == 1 else (10 + 24 / t) / 34
    p = layout.pipeline_parallel
    return share * min(p, layout.microbatches) / p


def _cast_copies(est: Estimate, layout: ParallelLayout, facts: ModelFacts) -> tuple[int, int]:
    """Autocast's half-precision copy of every weight (2 bytes each), which a sharded
    engine does not make (it gathers half-precision blocks, counted with the model
    states): (bytes saved for backward, bytes held only while the autocast region lasts).
    Checkpointed blocks drop their copies; their recompute makes one block's again."""
    recipe = est.recipe
    if not recipe.uses_autocast or layout.shard == "none":
        return 0, 0
    total = facts.parameters * 2
    recomputed = recipe.recomputed_blocks(facts.layers) / max(1, facts.layers)
    saved = int(total * (1 - recomputed)) if recipe.is_training else 0
    return saved, total - saved


def ddp_bucket_bytes(est: Estimate, layout: ParallelLayout) -> int:
    """The gradient buckets of PyTorch's DistributedDataParallel on each rank: a flat copy
    of every trainable gradient, allocated when DDP wraps the model and kept for the run.

    The reducer (``torch/csrc/distributed/c10d/reducer.cpp``, since PyTorch 1.1) gives
    each bucket its own ``at::empty`` of the bucket's summed length; gradients are copied
    into it for the all-reduce and back. Only ``gradient_as_bucket_view=True`` (PyTorch
    1.7+, off by default) makes the gradients views of the buckets instead. Pure data
    parallelism only: with tensor or pipeline parallelism, or a sharded engine, the
    engine's own buffers apply.

    The size is the trainable gradients the trace holds (their largest phase).
    """
    if layout.shard != "none" or layout.data_parallel < 2:
        return 0
    if layout.tensor_parallel > 1 or layout.pipeline_parallel > 1:
        return 0
    phases = est.details.get("phase_components") or {est.peak.phase: est.components}
    return max(components[Component.GRADIENTS] for components in phases.values())


def _replica_states(components: dict[str, int], layout: ParallelLayout, gpu_states: int) -> int:
    """The model states a rank holds in one phase: under plain data parallelism a full
    replica's, the phase's own (gradients freed by ``zero_grad(set_to_none=True)`` stay
    freed); under a sharding or model-parallel layout, ``gpu_states`` from the formulas."""
    plain = layout.tensor_parallel == 1 and layout.pipeline_parallel == 1
    if layout.shard == "none" and plain:
        return sum(components[k] for k in STATES)
    return gpu_states


def _rank_components(
    components: dict[str, int],
    phase: Phase,
    layout: ParallelLayout,
    gpu_states: int,
    buckets: int,
    cast: tuple[int, int],
    block_cast: int,
    ddp_buckets: int = 0,
) -> dict[str, int]:
    """One phase's peak components as a rank holds them: model states by the sharding
    formulas (with the optimizer offloaded, a rank keeps parameters and gradients only),
    and DDP's gradient buckets ``ddp_buckets`` with the gradients; activations, inputs
    and forward/backward temporaries by the layout's share, less the autocast weight
    copies ``cast`` (saved, held) that a sharded engine does not make — in backward only
    the recomputed block's ``block_cast``; the optimizer step's temporaries (param-sized
    lists of a foreach step) follow the states each rank updates, and stay on the host
    when it is offloaded."""
    gpu_states = _replica_states(components, layout, gpu_states)
    offloaded = Component.OPTIMIZER_STATE if layout.offload_optimizer else None
    kept = [k for k in STATES if k != offloaded]
    states = sum(components[k] for k in kept)
    rank = dict(components)
    for name in STATES:
        rank[name] = 0
    if states:
        for name in kept:
            rank[name] = int(gpu_states * components[name] / states)
    else:
        rank[Component.PARAMETERS] = gpu_states
    rank[Component.GRADIENTS] += ddp_buckets
    share = _activation_share(layout)
    cast_saved, cast_held = cast if phase != Phase.OPTIMIZER else (0, 0)
    if phase == Phase.BACKWARD and cast_held:
        cast_held = block_cast
    saved = min(cast_saved, components[Component.ACTIVATIONS])
    rank[Component.ACTIVATIONS] = int((components[Component.ACTIVATIONS] - saved) * share)
    rank[Component.INPUTS] = int(components[Component.INPUTS] * share)
    if phase == Phase.OPTIMIZER and layout.offload_optimizer:
        rank[Component.TEMPORARIES] = buckets  # the step runs on the host (DeepSpeed's CPU Adam)
    elif phase == Phase.OPTIMIZER:
        sharded = layout.shard != "none"
        divisor = (
            layout.tensor_parallel
            * layout.pipeline_parallel
            * (layout.data_parallel if sharded else 1)
        )
        rank[Component.TEMPORARIES] = components[Component.TEMPORARIES] // divisor + buckets
    else:
        unmade = cast_held + cast_saved - saved
        temporaries = max(0, components[Component.TEMPORARIES] - unmade)
        rank[Component.TEMPORARIES] = int(temporaries * share) + buckets
    return rank


def per_rank(est: Estimate, layout: ParallelLayout, facts: ModelFacts) -> Estimate:
    """The estimate of one rank (the first pipeline stage: the one holding the most): the
    highest of its phases, each phase's peak re-divided by the layout."""
    check_layout(layout, facts)
    if layout == ParallelLayout():
        return est
    gpu_states, host_states = _model_states(est, layout, facts)
    stage = {"zero1": 1, "zero2": 2, "zero3": 3}.get(layout.shard, 0)
    buckets = bucket_bytes(stage, facts.parameters // layout.tensor_parallel)
    phases = est.details.get("phase_components") or {est.peak.phase: est.components}
    cast = _cast_copies(est, layout, facts)
    block_cast = 2 * facts.largest_block_parameters if cast != (0, 0) else 0
    ddp = ddp_bucket_bytes(est, layout)
    candidates = {
        phase: _rank_components(
            components, phase, layout, gpu_states, buckets, cast, block_cast, ddp
        )
        for phase, components in phases.items()
        if phase != Phase.SETUP
    }
    phase, components = max(candidates.items(), key=lambda kv: sum(kv[1].values()))
    allocated = sum(components.values())
    fragmentation = (est.peak.reserved_bytes or est.peak.allocated_bytes) - est.peak.allocated_bytes
    reserved = allocated + int(fragmentation * (allocated / max(1, est.peak.allocated_bytes)))
    outside = (est.peak.device_total_bytes or 0) - (est.peak.reserved_bytes or 0)
    nccl = runtime_table()["nccl"]["per_communicator_bytes"] if layout.world_size > 1 else 0
    if est.runtime.get("nccl"):
        nccl = 0  # already in the single-GPU figure
    device_total = reserved + outside + nccl
    runtime = dict(est.runtime)
    runtime["nccl"] = runtime.get("nccl", 0) + nccl
    details = dict(est.details)
    details["parallel"] = {
        "layout": layout.describe(),
        "world_size": layout.world_size,
        "model_state_bytes_per_gpu": gpu_states,
        "host_state_bytes": host_states,
        "bucket_bytes": buckets,
        "ddp_bucket_bytes": ddp,
        "activation_share": round(_activation_share(layout), 4),
        "phase_peaks": {p: sum(c.values()) for p, c in candidates.items()},
    }
    notes = (
        *est.notes,
        f"per-rank figures for {layout.describe()}: model states by the "
        "sharding formulas, activations from the single-GPU trace scaled by the layout "
        "(DeepSpeed, and FSDP with TP/PP, are not traced themselves)",
    )
    if ddp:
        notes = (
            *notes,
            "DDP: the reducer's gradient buckets hold a second copy of every trainable "
            "gradient (gradient_as_bucket_view off, the default), counted with the gradients",
        )
    # the single-GPU range's widths carry over; the verdict reads the job's own memory
    # (the driver reserve an nvml-v1 total counts is outside the usable capacity)
    counted = (
        est.runtime.get("driver_reserved", 0) if est.details.get("used_counter") == "nvml-v1" else 0
    )
    central = est.peak.device_total_bytes or 0
    low, high = est.peak.device_total_range_bytes or (central, central)
    total_range = (device_total - (central - low), device_total + (high - central))
    peak = Peak(
        allocated_bytes=allocated,
        phase=phase,
        iteration=est.peak.iteration,
        reserved_bytes=reserved,
        device_total_bytes=device_total,
        fragmentation_bytes=reserved - allocated,
        device_total_range_bytes=total_range if est.peak.device_total_range_bytes else None,
    )
    verdict = None
    if est.verdict is not None:
        verdict = judge(
            est.verdict.gpu,
            est.verdict.capacity_bytes,
            est.verdict.headroom,
            device_total - counted,
            high=total_range[1] - counted,
        )
    return replace(
        est,
        components=components,
        peak=peak,
        runtime=runtime,
        details=details,
        notes=notes,
        verdict=verdict,
    )
