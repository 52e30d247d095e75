"""Which stretches of a run of blocks repeat once the recipe has chosen what recomputes.

``--checkpointing 12`` of 32 identical blocks makes two stretches: 12 checkpointed blocks,
then 20 plain ones; ``--checkpointing every:3`` makes one stretch of units of three blocks
(two plain, one checkpointed) and a tail of the blocks left over. Each stretch repeats on
its own; a short trace keeps a few units of each (``short_recipe`` says what it
checkpoints)::

    >>> segments(Recipe(checkpointing="12"), 32)
    (Segment(width=1, units=12), Segment(width=1, units=20))
    >>> segments(Recipe(checkpointing="every:3"), 32)
    (Segment(width=3, units=10), Segment(width=1, units=2))
    >>> short_recipe(Recipe(checkpointing="12"), (2, 3)).checkpointing
    '2'

Recipes that checkpoint a different number of leading blocks (and differ in nothing else)
share their short traces: ``family`` names what they have in common.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from vramplan.recipe import Recipe

CHECK = 4
"""The depth (in units) also traced to check the pattern: rebuilt from 2 and 3 it must
match. A stretch of at most this many units is traced as it is, save where short traces
are shared (``plan``): there one of 2 or more units is rebuilt from the short traces its
family shares, which the check at this depth proves."""


@dataclass(frozen=True)
class Segment:
    """``units`` consecutive units of ``width`` blocks each, every unit alike."""

    width: int
    units: int

    @property
    def blocks(self) -> int:
        return self.width * self.units

    @property
    def expands(self) -> bool:
        """Long enough to trace short and rebuild (else traced as it is)."""
        return self.units > CHECK


def segments(recipe: Recipe, blocks: int) -> tuple[Segment, ...]:
    """The stretches of ``blocks`` identical blocks once ``recipe``'s checkpointing is
    applied (one stretch when all or none of them recompute)."""
    if not recipe.is_training or recipe.checkpointing in ("none", "full", "op"):
        return (Segment(1, blocks),)
    every = recipe.checkpoint_every
    if every > 1:
        units, tail = divmod(blocks, every)
        return (Segment(every, units),) + ((Segment(1, tail),) if tail else ())
    limit = recipe.checkpoint_blocks or 0
    if limit >= blocks:
        return (Segment(1, blocks),)
    return (Segment(1, limit), Segment(1, blocks - limit))


def short_recipe(recipe: Recipe, units: tuple[int, ...]) -> Recipe:
    """``recipe`` for a model cut to ``units`` of each of ``segments(recipe, ...)``: the
    first N blocks checkpointed become the first stretch's units."""
    if recipe.checkpoint_blocks and len(units) == 2 and recipe.checkpoint_every == 1:
        return replace(recipe, checkpointing=str(units[0]))
    return recipe


def recomputed(recipe: Recipe, blocks: int) -> list[bool]:
    """Which of ``blocks`` blocks recompute under ``recipe`` (as ``chosen_blocks`` picks).

    >>> recomputed(Recipe(checkpointing="every:2"), 4)
    [False, True, False, True]
    """
    if not recipe.is_training or recipe.checkpointing == "none":
        return [False] * blocks
    limit = recipe.checkpoint_blocks
    every = recipe.checkpoint_every
    return [(limit is None or i < limit) and (i + 1) % every == 0 for i in range(blocks)]


def family(recipe: dict) -> str | None:
    """What the recipes whose short traces can be shared have in common (a recipe's
    ``to_json``): all but a count of checkpointed leading blocks, which the short traces
    cut to their own few units (``short_recipe``); None for other recipes.

    >>> family(Recipe(checkpointing="11").to_json()) == family(Recipe(checkpointing="21").to_json())
    True
    >>> family(Recipe(checkpointing="full").to_json()) is None
    True
    """
    if not str(recipe.get("checkpointing", "")).isdigit():
        return None
    return json.dumps({k: v for k, v in recipe.items() if k != "checkpointing"}, sort_keys=True)
