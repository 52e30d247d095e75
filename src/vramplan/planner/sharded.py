"""Confirm a GPU-count answer by tracing its sharding engine.

The search over world sizes and shardings (``distributed.needed``) uses the conservative
layout formulas, one trace for all candidates; the answer it settles on is then traced
through the engine itself where one can be traced (FSDP2)::

    answer = traced_answer(bench, gpus_needed(est, facts), recipe)
    answer.estimate.details["parallel"]["traced"]   # True when FSDP2 itself was traced
"""

from __future__ import annotations

from dataclasses import replace

from vramplan.distributed.fsdp import engine_for, with_traced_layout
from vramplan.distributed.needed import GpusNeeded
from vramplan.planner.bench import Workbench
from vramplan.recipe import Recipe


def traced_answer(bench: Workbench, answer: GpusNeeded, recipe: Recipe) -> GpusNeeded:
    """``answer`` with its per-rank estimate traced when its layout is pure FSDP."""
    engine = engine_for(answer.layout)
    if engine is None:
        return answer
    rank = with_traced_layout(bench.sharded(recipe, engine), answer.layout)
    return replace(answer, estimate=rank)
