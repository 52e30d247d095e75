"""The model facts a parallel layout needs, read from a built (meta) model.

>>> from vramplan.recipe import Recipe
>>> from vramplan.sources import resolve
>>> facts = facts_of(resolve("hf:gpt2", Recipe()))
>>> facts.parameters, facts.largest_block_parameters, facts.layers, facts.heads
(124439808, 7087872, 12, 12)
>>> facts.root_parameters  # token and position embeddings and the final layer norm
39385344
"""

from __future__ import annotations

from torch import nn

from vramplan.distributed.layout import ModelFacts
from vramplan.sources.base import BuiltModel
from vramplan.sources.blocks import repeated_blocks, true_repeated_blocks
from vramplan.trace.materialize import unique_parameters


def facts_of(built: BuiltModel) -> ModelFacts:
    """Parameter count, the largest repeated block, the block count and attention heads."""
    model = built.model
    blocks = repeated_blocks(model)
    config = getattr(model, "config", None)
    heads = None
    if config is not None:
        heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    if heads is None:  # the user's own transformer: torch's attention modules
        heads = next(
            (m.num_heads for m in model.modules() if isinstance(m, nn.MultiheadAttention)), None
        )
    largest = max((sum(p.numel() for p in block.parameters()) for block in blocks), default=0)
    params = unique_parameters(model)
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    return ModelFacts(
        parameters=sum(p.numel() for p in params),
        largest_block_parameters=largest,
        layers=len(blocks),
        heads=heads,
        repeated=bool(true_repeated_blocks(model)) or bool(built.blocks),
        root_parameters=sum(p.numel() for p in params if id(p) not in in_blocks),
    )
