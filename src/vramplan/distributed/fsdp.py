"""Trace PyTorch's own FSDP2 (``fully_shard``) as one rank of a fake process group.

The model is sharded on the meta device with ``fully_shard`` over a fake process group of
``world_size`` ranks (PyTorch's "fake" backend: collectives do nothing, shapes are real),
then traced like any step: the rank's sharded parameters, gradients and optimizer state,
the all-gathered blocks with their prefetching and resharding after forward, and the
reduce-scatter buffers are FSDP2's own allocations. FSDP2 runs its collectives on three
side streams; each allocation keeps its stream, so the allocator model does not reuse a
communication stream's cached blocks for compute::

    engine = Fsdp2(world_size=8)
    trace = trace_training(built, recipe, policy, engine)   # one rank of eight
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from vramplan.distributed.layout import STATES, ParallelLayout
from vramplan.errors import UserError
from vramplan.recipe import Recipe
from vramplan.result import Component, Estimate
from vramplan.sources.blocks import chosen_blocks, repeated_blocks
from vramplan.trace.recorder import AllocationRecorder, StorageRecord

_HALF = {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}
_STREAMS = (
    ("all_gather_copy_in_stream", "all_gather"),
    ("all_gather_stream", "all_gather"),
    ("reduce_scatter_stream", "reduce_scatter"),
    ("all_reduce_stream", "all_reduce"),
)


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[object]:
    """A fake process group of ``world_size`` ranks (we are rank 0) and its 1-D CPU mesh."""
    import torch.testing._internal.distributed.fake_pg as fake_pg  # registers "fake"
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        raise UserError("a process group is already initialised in this process")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class Fsdp2:
    """FSDP2 over ``world_size`` data-parallel ranks: ``fully_shard`` on every repeated
    block and on the root. ``reshard_after_forward=False`` keeps each block gathered from
    forward to backward (ZeRO-2-like, ``--shard grad-op``). With amp precisions the
    blocks are gathered in half precision (``MixedPrecisionPolicy(param_dtype=half,
    reduce_dtype=float32)``) and autocast stays on, as a single-GPU amp script that adds
    ``fully_shard`` runs. ``version=1`` is FSDP1 (``FullyShardedDataParallel``) as the same
    per-parameter shards plus what FSDP1 holds under reentrant checkpointing
    (``fsdp1_held_blocks``); ``hold_block_inputs`` holds for every block."""

    world_size: int
    reshard_after_forward: bool = True
    version: int = 2
    """2: FSDP2; 1: FSDP1, traced as FSDP2 plus ``fsdp1_held_blocks``."""
    hold_block_inputs: bool = False
    """Keep every block's input and its gradient until backward ends, as FSDP1 does under
    reentrant checkpointing (``_held_block_inputs``), whatever the recipe."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise UserError(f"FSDP world size must be at least 1, got {self.world_size}")
        if self.version not in (1, 2):
            raise UserError(f"--fsdp-version must be 1 or 2, got {self.version}")

    @contextlib.contextmanager
    def applied(self, model: nn.Module, recipe: Recipe) -> Iterator[list[str]]:
        """Shard the meta ``model`` in place for the duration; yields notes."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        half = _HALF.get(recipe.precision)
        reduce = torch.float32 if half else None
        policy = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=reduce)
        with fake_process_group(self.world_size) as mesh:
            blocks = [b for b in repeated_blocks(model) if any(True for _ in b.parameters())]
            for block in blocks:
                fully_shard(
                    block,
                    mesh=mesh,
                    reshard_after_forward=self.reshard_after_forward,
                    mp_policy=policy,
                )
            fully_shard(
                model, mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=policy
            )
            gathered = f"{half}".replace("torch.", "") if half else "their own dtype"
            held = blocks if self.hold_block_inputs else []
            if self.version == 1 and not held:
                held = fsdp1_held_blocks(model, blocks, recipe)
            with _held_block_inputs(held) if held else contextlib.nullcontext():
                yield [
                    f"FSDP2 traced as rank 0 of {self.world_size} on a fake process group: "
                    f"fully_shard on {len(blocks)} blocks and the root, gathered in {gathered}, "
                    + (
                        "resharded after forward"
                        if self.reshard_after_forward
                        else "kept gathered from forward to backward"
                    )
                    + (
                        f"; {len(held)} blocks' inputs and their gradients held until backward "
                        "ends (FSDP1 under reentrant checkpointing)"
                        if held
                        else ""
                    ),
                    *([fsdp1_note(recipe, len(held))] if self.version == 1 else []),
                ]

    @contextlib.contextmanager
    def watching(
        self, model: nn.Module, recorder: AllocationRecorder, notes: list[str]
    ) -> Iterator[None]:
        """Follow FSDP2's side streams while tracing, settle what its buffers are, and turn
        FSDP2's warnings about the model into notes."""
        with warnings.catch_warnings(record=True) as caught, _side_streams(model, recorder):
            warnings.simplefilter("always")
            yield
        for record in recorder.records:
            _classify(record)
        said = {str(w.message).split(". ")[0] for w in caught if "FSDP" in str(w.message)}
        notes.extend(f"FSDP2 warns: {message}" for message in sorted(said))

    @staticmethod
    def initialise(model: nn.Module) -> None:
        """FSDP2's lazy initialisation (root state, padded shards), run before tagging."""
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            model._get_fsdp_state()._lazy_init()


def fsdp1_held_blocks(model: nn.Module, blocks: list[nn.Module], recipe: Recipe) -> list:
    """Of FSDP's ``blocks``, those whose input FSDP1 holds to the end of backward: blocks
    that recompute through reentrant checkpointing (``recipe.reentrant``) and whose own
    FSDP1 unit is frozen.

    FSDP1 registers the reshard-only hook only for a flat parameter that does not require
    grad (``_register_post_backward_reshard_only_hook`` in
    ``torch/distributed/fsdp/_runtime_utils.py`` returns on ``flat_param.requires_grad``),
    and a flat parameter requires grad when any of its parameters does (``_flat_param.py``,
    ``_validate_tensors_to_flatten``). Under LoRA, peft's ``fsdp_auto_wrap_policy`` (which
    transformers' Trainer installs for a peft model: ``update_fsdp_plugin_peft`` in
    ``transformers/distributed/fsdp.py``, 5.24) makes every leaf with a trainable ``weight``
    a unit of its own, so a block whose only trainable parameters are adapters is frozen;
    in full fine-tuning no block is::

        with Fsdp2(2, version=1).applied(model, recipe):   # recipe.reentrant, LoRA
            ...   # fsdp1_held_blocks(model, blocks, recipe) == every recomputed block
    """
    if not (recipe.reentrant and recipe.is_training and recipe.checkpointing != "none"):
        return []
    recomputed = chosen_blocks(
        repeated_blocks(model), recipe.checkpoint_blocks, recipe.checkpoint_every
    )
    ids = {id(b) for b in recomputed}
    return [b for b in blocks if id(b) in ids and _frozen_unit(b, peft_units=recipe.lora_rank > 0)]


def _frozen_unit(block: nn.Module, peft_units: bool) -> bool:
    """Whether ``block``'s FSDP1 flat parameter is frozen: none of its parameters requires
    grad, leaving out (with ``peft_units``) leaves with a trainable ``weight``, which peft's
    wrap policy (``peft/utils/other.py``, ``lambda_policy_fn``) wraps on their own."""
    own = {id(p) for p in block.parameters()}
    if peft_units:
        for module in block.modules():
            weight = getattr(module, "weight", None)
            leaf = next(module.children(), None) is None
            if leaf and isinstance(weight, torch.Tensor) and weight.requires_grad:
                own -= {id(p) for p in module.parameters()}
    return not any(p.requires_grad for p in block.parameters() if id(p) in own)


def fsdp1_note(recipe: Recipe, held: int) -> str:
    """What ``--fsdp-version 1`` adds to the FSDP2 trace, and what it leaves as FSDP2's."""
    if held:
        what = (
            f"{held} frozen blocks recomputed by reentrant checkpointing keep their input and "
            "its gradient until backward ends (FSDP1's reshard-only hook)"
        )
    else:
        what = "nothing held: FSDP1 keeps a block's input only for a frozen unit " + (
            "and reentrant checkpointing (--reentrant)" if not recipe.reentrant else "(none here)"
        )
    return (
        f"FSDP1: {what}; its flat parameters traced as FSDP2's per-parameter shards (the "
        "same bytes per rank up to padding: FSDP1 pads each flat parameter to a multiple of "
        "the world size, FSDP2 each parameter's first dimension); its all-gathers "
        "(limit_all_gathers: two in flight at most) and mixed-precision copies traced as FSDP2's"
    )


@contextlib.contextmanager
def _held_block_inputs(blocks: list[nn.Module]) -> Iterator[None]:
    """Hold each block's input and the gradient computed for it until backward ends.

    FSDP1 registers its reshard hook for a frozen unit on the unit's forward inputs
    (``_register_post_backward_reshard_only_hook``: ``register_multi_grad_hook`` keeps the
    inputs' ``AccumulateGrad`` nodes). Under reentrant checkpointing (transformers 4.x's
    default) those inputs are the detached leaves ``CheckpointFunction.backward`` recomputes
    from, which share the checkpointed hidden state's storage and carry its gradient in
    ``.grad``; the cycle tensor -> hook -> node -> tensor lives until the hooks go, so each
    block's checkpoint and input gradient outlive its backward. Releasing them when the
    backward ends is an assumption (FSDP1's final callback)::

        with _held_block_inputs(blocks):
            loss.backward()   # block inputs and their gradients freed as it returns
    """
    held: list[torch.Tensor] = []
    queued = [False]

    def release() -> None:
        held.clear()
        queued[0] = False

    def keep_gradient(grad: torch.Tensor) -> None:
        if not queued[0]:
            torch.autograd.Variable._execution_engine.queue_callback(release)
            queued[0] = True
        held.append(grad)

    def keep_input(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled():
            return
        leaves, _ = torch.utils._pytree.tree_flatten((args, kwargs))
        first = next((t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if first is None or any(first is t for t in held):  # a recompute of the same input
            return
        held.append(first)
        first.register_hook(keep_gradient)

    handles = [b.register_forward_pre_hook(keep_input, with_kwargs=True) for b in blocks]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        held.clear()


def _classify(record: StorageRecord) -> None:
    """All-gather buffers and unsharded parameters are parameters (gathered); the
    reduce-scatter buffers carry gradients."""
    if "resized" in record.tags or record.op.startswith("all_gather:"):
        record.tags.add(Component.PARAMETERS)
    elif record.op.startswith(("reduce_scatter:", "all_reduce:")):
        record.tags.add(Component.GRADIENTS)


@contextlib.contextmanager
def _side_streams(model: nn.Module, recorder: AllocationRecorder) -> Iterator[None]:
    """Number FSDP2's streams as it enters them (``torch.cpu.stream`` on our fake CPU
    mesh) and label them from its communication context."""
    original = torch.cpu.stream
    numbers: dict[int, int] = {}

    def label_of(stream: object) -> str:
        state = model._get_fsdp_state() if hasattr(model, "_get_fsdp_state") else None
        context = getattr(state, "_comm_ctx", None)
        for attribute, label in _STREAMS:
            if getattr(context, attribute, None) is stream:
                return label
        return ""

    @contextlib.contextmanager
    def stream(side_stream):
        previous = (recorder.stream, recorder.stream_label)
        label = label_of(side_stream)
        if label:
            recorder.stream = numbers.setdefault(id(side_stream), len(numbers) + 1)
            recorder.stream_label = label
        else:
            recorder.stream, recorder.stream_label = 0, ""
        try:
            with original(side_stream):
                yield
        finally:
            recorder.stream, recorder.stream_label = previous

    torch.cpu.stream = stream
    try:
        yield
    finally:
        torch.cpu.stream = original


def engine_for(layout: ParallelLayout) -> Fsdp2 | None:
    """The engine that traces ``layout`` itself: FSDP2 when it is pure FSDP data
    parallelism (with tensor or pipeline parallelism the layout formulas apply).

    >>> from vramplan.distributed.layout import ParallelLayout
    >>> engine_for(ParallelLayout(shard="fsdp", data_parallel=8, fsdp_version=1))
    Fsdp2(world_size=8, reshard_after_forward=True, version=1, hold_block_inputs=False)
    """
    if layout.shard not in ("fsdp", "fsdp-grad-op"):
        return None
    if layout.tensor_parallel > 1 or layout.pipeline_parallel > 1:
        return None
    return Fsdp2(
        layout.data_parallel,
        reshard_after_forward=layout.shard == "fsdp",
        version=layout.fsdp_version,
    )


def with_traced_layout(est: Estimate, layout: ParallelLayout) -> Estimate:
    """``est`` (traced as one rank) with the layout's summary in ``details["parallel"]``,
    in the same shape as the formula path's."""
    states = sum(est.components[k] for k in STATES)
    details = dict(est.details)
    details["parallel"] = {
        "layout": layout.describe(),
        "world_size": layout.world_size,
        "traced": True,
        "model_state_bytes_per_gpu": states,
        "host_state_bytes": 0,
        "bucket_bytes": 0,
        "activation_share": 1.0,
        "phase_peaks": dict(est.phase_peaks),
    }
    return replace(est, details=details)
