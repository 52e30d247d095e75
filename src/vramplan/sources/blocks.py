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


def _checkpointed(forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


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


def checkpoint_repeated_blocks(model: nn.Module, limit: int | None = None) -> int:
    """Recompute the repeated blocks (the first ``limit`` of them, or all) in backward;
    return how many repeated blocks the model has."""
    blocks = true_repeated_blocks(model)
    for block in blocks[:limit]:
        block.forward = _checkpointed(block.forward)
    return len(blocks)
