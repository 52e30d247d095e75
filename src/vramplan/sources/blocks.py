"""Activation checkpointing on the repeated blocks of any model.

The blocks are the children of the containers (``nn.Sequential``, ``nn.ModuleList``)
whose members repeat one class: ResNet's bottlenecks, a transformer's layers::

    >>> layers = nn.Sequential(*[nn.Linear(8, 8) for _ in range(24)])
    >>> checkpoint_repeated_blocks(nn.Sequential(nn.Embedding(10, 8), layers))
    24
"""

from __future__ import annotations

import functools

import torch.utils.checkpoint
from torch import nn


def _repeated_block_containers(model: nn.Module) -> list[nn.Module]:
    found = []
    for module in model.modules():
        if isinstance(module, (nn.Sequential, nn.ModuleList)) and len(module) >= 2:
            kinds = {type(child) for child in module}
            if len(kinds) == 1 and not isinstance(module[0], (nn.Sequential, nn.ModuleList)):
                found.append(module)
    return found


def block_containers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The containers whose children repeat one class, with their qualified names."""
    names = {id(m): name for name, m in model.named_modules()}
    return [(names[id(c)], c) for c in _repeated_block_containers(model)]


def _checkpointed(forward, ops: bool = False):
    options = checkpoint_options(ops)

    @functools.wraps(forward)
    def run(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(forward, *args, **options, **kwargs)

    return run


def _saved_ops() -> set:
    """torchtitan's ``_save_list``: the ops whose outputs op-level selective checkpointing
    keeps (matmuls, attention, the max used for float8 scales, reduce-scatter)."""
    aten = torch.ops.aten
    names = [
        (aten.mm, "default"),
        (aten._scaled_dot_product_efficient_attention, "default"),
        (aten._scaled_dot_product_flash_attention, "default"),
        (aten._scaled_dot_product_cudnn_attention, "default"),
        (aten.max, "default"),
    ]
    functional = getattr(torch.ops, "_c10d_functional", None)
    if functional is not None and hasattr(functional, "reduce_scatter_tensor"):
        names.append((functional.reduce_scatter_tensor, "default"))
    return {getattr(packet, overload) for packet, overload in names if hasattr(packet, overload)}


def op_policy_context():
    """The contexts of one checkpointed call under torchtitan's op-level policy: save the
    outputs of the listed ops, except every second matmul, and recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = _saved_ops()
    mm = torch.ops.aten.mm.default
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == mm:
            counts[mode] += 1
        keep = func in saved and not (func == mm and counts[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpoint_options(ops: bool = False) -> dict:
    """Keyword arguments of ``torch.utils.checkpoint.checkpoint``: non-reentrant, and with
    ``ops`` torchtitan's op-level selective policy."""
    options: dict = {"use_reentrant": False}
    if ops:
        options["context_fn"] = op_policy_context
    return options


def true_repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The members of containers that repeat one block class, outermost first; empty
    when nothing repeats."""
    blocks = [child for container in _repeated_block_containers(model) for child in container]
    nested = {id(m) for b in blocks for m in b.modules() if m is not b}
    return [b for b in blocks if id(b) not in nested]


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks in forward order (its direct children when nothing
    repeats)."""
    return true_repeated_blocks(model) or list(model.children())


def chosen_blocks(blocks: list, limit: int | None = None, every: int = 1) -> list:
    """Of ``blocks``, those that recompute: the first ``limit`` (or all), and of those every
    ``every``-th, counted from one as torchtitan does (``every=2``: the 2nd, 4th, ...).

    >>> chosen_blocks(list("abcde"), every=2)
    ['b', 'd']
    """
    return [b for i, b in enumerate(blocks[:limit], start=1) if i % every == 0]


def checkpoint_repeated_blocks(
    model: nn.Module, limit: int | None = None, every: int = 1, ops: bool = False
) -> int:
    """Recompute the repeated blocks (the first ``limit`` of them, or all; every
    ``every``-th of those; with ``ops`` only what torchtitan's op policy does not save) in
    backward; return how many repeated blocks the model has."""
    blocks = true_repeated_blocks(model)
    for block in chosen_blocks(blocks, limit, every):
        block.forward = _checkpointed(block.forward, ops)
    return len(blocks)
