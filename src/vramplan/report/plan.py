"""The terminal renderings of ``max-batch`` and ``plan``, and the plan table of the HTML
report.

    render_plan(session.plan(batch_size=8), "binary")
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from vramplan.distributed.needed import host_state_bytes
from vramplan.units import format_bytes

SEARCHED = {"batch_size": "batch size", "prompt_len": "prompt length", "new_tokens": "new tokens"}

if TYPE_CHECKING:
    from vramplan.planner.answer import PlanAnswer
    from vramplan.planner.search import SearchResult


def trace_summary(traced: tuple[tuple[str, float], ...]) -> str:
    """``7 traces in 41.2 s (slowest 9.8 s: hf:gpt2: FLOPs, batch 8, fp32, adamw)``.

    >>> trace_summary((("a: batch 1", 1.25), ("a: batch 2", 2.5)))
    '2 traces in 3.8 s (slowest 2.5 s: a: batch 2)'
    >>> trace_summary(())
    'no new traces (all reused)'
    """
    if not traced:
        return "no new traces (all reused)"
    label, slowest = max(traced, key=lambda record: record[1])
    total = sum(seconds for _, seconds in traced)
    count = f"{len(traced)} trace{'s' if len(traced) != 1 else ''}"
    return f"{count} in {total:.1f} s (slowest {slowest:.1f} s: {label})"


def render_max_batch(result: SearchResult, units: str) -> None:
    """The answer of a max-batch search, the step beyond it, and what it cost."""
    fmt = lambda n: format_bytes(n, units)  # noqa: E731
    est = result.estimate
    label = SEARCHED.get(result.knob, "sequence length")
    layout = est.details.get("parallel", {}).get("layout")
    where = f"each {est.verdict.gpu} of {layout} (one rank's peak)" if layout else est.verdict.gpu
    per_gpu = "per-GPU " if layout and result.knob == "batch_size" else ""
    console = Console()
    console.print(
        f"Largest {per_gpu}{label} that fits {escape(where)} with {est.verdict.headroom:.0%} "
        f"headroom: [bold]{result.value}[/bold]"
    )
    console.print(
        f"  at {result.value}: the job's high end {fmt(est.verdict.compared_bytes)} of "
        f"{fmt(est.verdict.usable_bytes)} usable, {fmt(est.verdict.spare_bytes)} to spare "
        f"(central device total {fmt(est.peak.device_total_bytes)}, allocated "
        f"{fmt(est.peak.allocated_bytes)}, reserved {fmt(est.peak.reserved_bytes)})"
    )
    if result.beyond is not None:
        console.print(
            f"  at {result.value + 1}: high end {fmt(result.beyond.verdict.compared_bytes)} — "
            f"{result.beyond.verdict.status.upper()}"
        )
    console.print(
        f"[dim]{escape(trace_summary(result.traced))}; a doubling-and-bisection finder would run "
        f"{result.bisection_traces} trials. Sizes in {units} units.[/dim]",
        highlight=False,
    )


def saves(lever, units: str) -> str:
    """What a lever saves: the device total's drop, then the tensors' (allocated peak)."""
    return (
        f"{format_bytes(lever.saved_bytes, units)} · "
        f"{format_bytes(lever.saved_allocated_bytes, units)}"
    )


def plan_rows(answer: PlanAnswer, units: str) -> list[list[str]]:
    """Header and rows of the levers (and the plan) for the HTML report."""
    result = answer.levers
    fmt = lambda n: format_bytes(n, units)  # noqa: E731
    rows = [["lever", "flags", "device total", "saves (device · tensors)", "status"]]
    rows += [
        [
            lever.name,
            lever.flags,
            fmt(lever.estimate.peak.device_total_bytes),
            saves(lever, units),
            lever.status.upper(),
        ]
        for lever in result.levers
    ]
    if result.plan is not None:
        rows.append(
            [
                f"plan: {result.plan.name}",
                result.plan.flags,
                fmt(result.plan.estimate.peak.device_total_bytes),
                saves(result.plan, units),
                result.plan.status.upper(),
            ]
        )
    return rows


def render_plan(answer: PlanAnswer, units: str) -> None:
    """Levers, the first plan, the GPUs table, host RAM, and the GPUs needed."""
    result, fleet, host = answer.levers, answer.fleet, answer.host
    all_gpus = answer.judged_every_gpu
    fmt = lambda n: format_bytes(n, units)  # noqa: E731
    console = Console()
    base = result.baseline
    layout = base.details.get("parallel", {}).get("layout")
    rank = f" per rank of {escape(layout)}" if layout else ""
    console.print(
        f"[bold]{base.model.name}[/bold]: device total{rank} {fmt(base.peak.device_total_bytes)}"
        f" (allocated {fmt(base.peak.allocated_bytes)}, reserved "
        f"{fmt(base.peak.reserved_bytes)})"
    )
    if not all_gpus:
        v = base.verdict
        console.print(
            f"On {v.gpu} ({fmt(v.capacity_bytes)}, {v.headroom:.0%} headroom): "
            f"[bold]{v.status.upper()}[/bold]"
        )
    table = Table(title="Levers, each alone, in the standard order", title_justify="left")
    table.caption = (
        "saves: the device total's drop · the allocated peak's (tensors can shrink while "
        "cached segments and the runtime keep the device total)"
    )
    table.caption_justify = "left"
    for column in ("lever", "device total", "saves", "status", "cost"):
        table.add_column(column, justify="right" if column in ("device total", "saves") else "left")
    for lever in result.levers:
        cost = ", ".join(
            f"{k.replace('_', ' ')}: {v:.0%}"
            if isinstance(v, float)
            else f"{k.removesuffix('_bytes').replace('_', ' ')}: {fmt(v)}"
            if k.endswith("_bytes")
            else f"{k.replace('_', ' ')}: {v}"
            for k, v in lever.cost.items()
        )
        table.add_row(
            lever.name,
            fmt(lever.estimate.peak.device_total_bytes),
            saves(lever, units),
            lever.status.upper(),
            cost,
        )
    console.print(table)
    # the flags to copy stay whole on lines of their own, whatever the terminal's width
    console.print("Flags of each lever:")
    for lever in result.levers:
        console.print(f"  {lever.name}: {lever.flags}", soft_wrap=True, highlight=False)
    if result.plan is not None:
        plan = result.plan
        console.print(
            f"First plan that fits: [bold]{plan.name}[/bold] → {plan.flags} "
            f"(device total {fmt(plan.estimate.peak.device_total_bytes)}, "
            f"{plan.status.upper()})",
            soft_wrap=True,
        )
    if all_gpus or any(row.status != "fits" for row in fleet):
        gpus = Table(title="GPUs", title_justify="left")
        for column in ("gpu", "memory", "as is", "fits with"):
            gpus.add_column(column)
        for row in fleet:
            gpus.add_row(
                row.gpu,
                fmt(row.capacity_bytes),
                row.status.upper(),
                row.levers and f"{row.levers} ({row.flags})",
            )
        console.print(gpus)
    console.print(
        "Host RAM: "
        + ", ".join(f"{k.replace('_', ' ')} {fmt(v)}" for k, v in host.terms.items() if v)
        + f" — total {fmt(host.total_bytes)}"
    )
    if host.exceeds_limit:
        console.print(
            f"[bold red]warning:[/bold red] host RAM {fmt(host.total_bytes)} exceeds "
            f"--host-memory {fmt(host.limit_bytes)}"
        )
    for note in result.notes:
        console.print(f"[dim]note: {note}[/dim]")
    console.print(
        f"[dim]{escape(trace_summary(answer.traced))}. Sizes in {units} units.[/dim]",
        highlight=False,
    )
    needed, needed_note = answer.needed, answer.needed_note
    if needed is not None:
        rank = format_bytes(needed.estimate.peak.device_total_bytes, units)
        offloaded_bytes = host_state_bytes(needed.estimate)
        offloaded = (
            f"; offloaded state on the host: {format_bytes(offloaded_bytes, units)}"
            if offloaded_bytes
            else ""
        )
        console.print(
            f"Needs [bold]{needed.gpus} x {result.baseline.verdict.gpu}[/bold] with "
            f"[bold]{needed.layout.describe()}[/bold] {needed_note}: {rank} per GPU, "
            f"{needed.estimate.verdict.status.upper()}{offloaded}"
        )
    elif needed_note:
        console.print(f"[bold red]No layout fits:[/bold red] {needed_note}")
