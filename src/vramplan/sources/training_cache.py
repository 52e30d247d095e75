"""``--kv-in-training``: the key/value cache transformers 4.x's gpt_bigcode returned in
training, under gradient checkpointing too.

In 4.48.1, 4.50.0 and 4.52.1 (read in their wheels), ``GPTBigCodeModel.forward`` took
``use_cache`` from the config (``use_cache: true`` in the bigcode configs) and, unlike
Llama's or GPT-2's forward, did not switch it off under gradient checkpointing. Each
block's attention returned ``present = key_value``, a slice of its fused projection's
output (``self.c_attn(hidden_states).split(...)``), the model gathered them in
``presents`` and ``CausalLMOutputWithCrossAttentions.past_key_values`` held them until the
Trainer's ``compute_loss`` returned the loss. So every block's whole ``c_attn`` output
(``[batch, seq, hidden + 2 x kv]``) stays on the card from its block to the loss, beside
the logits, although checkpointing drops everything else a block made; at backward the
output, and the cache with it, is gone. In transformers 5 (5.24 checked) ``GPTBigCodeBlock``
is a ``GradientCheckpointingLayer``, which drops the cache under checkpointing.

The installed transformers keeps no cache in a checkpointed training step, so the recipe
asks for it: the traced step keeps each ``c_attn`` output its forward makes until its loss
is taken::

    >>> from vramplan.recipe import Recipe
    >>> Recipe(kv_in_training=True).kv_in_training
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from vramplan.errors import UserError
from vramplan.recipe import Recipe
from vramplan.sources.base import Batch, BuiltModel

MODEL_TYPES = ("gpt_bigcode",)
"""The models whose 4.x forward kept the cache in a checkpointed training step."""
PROJECTION = "c_attn"
"""The fused query/key/value projection whose output the cache slices."""


def keep_training_cache(built: BuiltModel, recipe: Recipe) -> None:
    """Make ``built``'s training step hold its blocks' key/value cache until the loss, as
    transformers 4.x's gpt_bigcode did (``--kv-in-training``); nothing without the flag."""
    if not recipe.kv_in_training:
        return
    model_type = getattr(getattr(built.model, "config", None), "model_type", None)
    if model_type not in MODEL_TYPES:
        raise UserError(
            f"--kv-in-training is transformers 4.x gpt_bigcode's cache in training; "
            f"{built.name} is {model_type or 'not a transformers model'}"
        )
    if not recipe.is_training:
        raise UserError("--kv-in-training is a training step's cache; this recipe does not train")
    run = built.run

    def run_keeping_cache(module: nn.Module, batch: Batch, training: bool) -> Any:
        if not training:
            return run(module, batch, training)
        with kept_projections(module):
            return run(module, batch, training)

    built.run = run_keeping_cache
    built.notes.append(
        "key/value cache kept in training (transformers 4.x gpt_bigcode: use_cache stays on "
        "under gradient checkpointing): each block's c_attn output lives until the loss"
    )


@contextlib.contextmanager
def kept_projections(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Every output of a module named ``c_attn`` (a peft-wrapped one's, adapters included)
    made inside the ``with`` block, held until it ends, as the model's ``presents`` held
    them until the loss.

    >>> inner = nn.Module()
    >>> inner.c_attn = nn.Linear(2, 6)
    >>> with kept_projections(inner) as kept:
    ...     _ = inner.c_attn(torch.ones(1, 2))
    ...     print([tuple(t.shape) for t in kept])
    [(1, 6)]
    >>> kept
    []
    """
    kept: list[torch.Tensor] = []
    handles = [
        module.register_forward_hook(lambda _module, _args, output: kept.append(output))
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] == PROJECTION
    ]
    try:
        yield kept
    finally:
        for handle in handles:
            handle.remove()
        kept.clear()
