"""The whole answer of ``plan``: levers, the first plan that fits, the GPUs each card
needs, host RAM, and how many GPUs it takes when nothing fits one card.

    answer = answer_plan(bench, Recipe(batch_size=8, seq_len=4096), judge_every_gpu=False,
                         host=HostOptions(limit_bytes=64 * 2**30))
    answer.needed.gpus if answer.needed else answer.levers.plan.flags
"""

from __future__ import annotations

from dataclasses import dataclass

from vramplan.device.catalog import catalog
from vramplan.distributed.facts import facts_of
from vramplan.distributed.layout import ParallelLayout
from vramplan.distributed.needed import GpusNeeded, gpus_needed
from vramplan.errors import UserError
from vramplan.planner.bench import Workbench
from vramplan.planner.fleet import GpuFit, gpus_that_fit
from vramplan.planner.host import HostMemory, HostOptions, host_memory
from vramplan.planner.levers import PlanResult, plan_levers
from vramplan.planner.sharded import traced_answer
from vramplan.recipe import Recipe


@dataclass(frozen=True)
class PlanAnswer:
    """What ``vramplan plan`` prints and ``--json`` serialises (``vramplan.plan/1``)."""

    levers: PlanResult
    fleet: tuple[GpuFit, ...]
    host: HostMemory
    traces: int
    judged_every_gpu: bool
    needed: GpusNeeded | None = None
    needed_note: str = ""
    """With ``needed``: the extra condition (``with --checkpointing full``); without it:
    why no layout fits."""
    traced: tuple[tuple[str, float], ...] = ()
    """What each trace was and its seconds (build, trace and device replay)."""
    side_by_side: int = 0
    """Of the traces, how many ran in worker processes (``--jobs``, ``parallel.py``)."""

    @property
    def trace_seconds(self) -> tuple[float, ...]:
        return tuple(seconds for _, seconds in self.traced)

    def to_json(self) -> dict:
        data = self.levers.to_json()
        data["gpus"] = [row.to_json() for row in self.fleet]
        data["host"] = self.host.to_json()
        data["traces"] = self.traces
        data["trace_seconds"] = [round(seconds, 3) for seconds in self.trace_seconds]
        data["trace_labels"] = [label for label, _ in self.traced]
        data["traces_side_by_side"] = self.side_by_side
        if self.needed is not None:
            data["gpus_needed"] = {**self.needed.to_json(), "with": self.needed_note}
        else:
            data["gpus_needed"] = (
                {"answer": None, "why": self.needed_note} if self.needed_note else None
            )
        return data


def answer_plan(
    bench: Workbench, recipe: Recipe, *, judge_every_gpu: bool, host: HostOptions
) -> PlanAnswer:
    """Levers on ``bench``'s card; the GPUs needed when none of them fits; every catalog
    card (``judge_every_gpu``) or just this one, with the levers that make each fit."""
    before, side_before = bench.traces, bench.log.side_by_side
    bench.shares_short_traces = True  # its estimates differ in the checkpointed count
    bench.counts_flops = True  # recompute costs read off the steps' own traces
    with bench.side_by_side(recipe):  # the levers, floors and trials side by side (--jobs)
        levers = plan_levers(bench, recipe)
    needed, needed_note = None, ""
    if not judge_every_gpu and levers.baseline.verdict.status != "fits" and levers.plan is None:
        needed, needed_note = gpus_needed_for(bench, recipe, host.limit_bytes)
    options = [  # sharding levers change the layout: each card is judged at the user's
        lever for lever in (*levers.levers, levers.plan) if lever and not lever.layout_flags
    ]
    cards = catalog() if judge_every_gpu else (bench.device.card,)
    fleet = gpus_that_fit(bench, recipe, options, cards)
    details = levers.baseline.details  # under ZeRO-Offload, the layout's host share
    offloaded = details.get("parallel", {}).get("host_state_bytes")
    ram = host_memory(levers.baseline, host, offloaded or details.get("optimizer_state_bytes"))
    return PlanAnswer(
        levers,
        tuple(fleet),
        ram,
        bench.traces - before,
        judge_every_gpu,
        needed,
        needed_note,
        bench.log.since(before),
        bench.log.side_by_side - side_before,
    )


def gpus_needed_for(
    bench: Workbench, recipe: Recipe, host_limit: int | None
) -> tuple[GpusNeeded | None, str]:
    """GPUs needed as the recipe stands; failing that, with full checkpointing. An FSDP
    answer is then traced through FSDP2 itself; offload that overflows ``host_limit`` is
    not an answer. Under the bench's layout, from its data-parallel GPU count up. Returns
    the answer and its condition, or ``None`` and why."""
    layout = bench.layout
    if layout.tensor_parallel > 1 or layout.pipeline_parallel > 1:
        return None, (
            "with tensor or pipeline parallelism, the GPUs-needed search (data parallelism "
            "over one-GPU steps) does not apply"
        )
    single = bench.under(ParallelLayout())
    facts = facts_of(single.built(recipe))
    start = layout.data_parallel
    try:
        answer = gpus_needed(single.estimate(recipe), facts, host_limit, start)
        return traced_answer(single, answer, recipe), ""
    except UserError as exc:
        if recipe.checkpointing == "full" or not recipe.is_training:
            return None, str(exc)
    checkpointed = recipe.with_changes(checkpointing="full")
    try:
        answer = gpus_needed(single.estimate(checkpointed), facts, host_limit, start)
        return traced_answer(single, answer, checkpointed), "with --checkpointing full"
    except UserError as exc:
        return None, str(exc)
