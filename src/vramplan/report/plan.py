"""The terminal renderings of ``max-batch`` and ``plan``, and the plan table of the HTML
report.

    render_plan(session.plan(batch_size=8), "binary")
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from vramplan.distributed.needed import host_state_bytes
from vramplan.plan.answer import PlanAnswer
from vramplan.plan.search import SearchResult
from vramplan.units import format_bytes


def render_max_batch(result: SearchResult, units: str) -> None:
    """The answer of a max-batch search, the step beyond it, and what it cost."""
    fmt = lambda n: format_bytes(n, units)  # noqa: E731
    est = result.estimate
    label = "batch size" if result.knob == "batch_size" else "sequence length"
    console = Console()
    console.print(
        f"Largest {label} that fits {est.verdict.gpu} with {est.verdict.headroom:.0%} "
        f"headroom: [bold]{result.value}[/bold]"
    )
    console.print(
        f"  at {result.value}: device total {fmt(est.peak.device_total_bytes)} of "
        f"{fmt(est.verdict.usable_bytes)} usable (allocated "
        f"{fmt(est.peak.allocated_bytes)}, reserved {fmt(est.peak.reserved_bytes)}), "
        f"{fmt(est.verdict.spare_bytes)} to spare"
    )
    if result.beyond is not None:
        console.print(
            f"  at {result.value + 1}: {fmt(result.beyond.peak.device_total_bytes)} — "
            f"{result.beyond.verdict.status.upper()}"
        )
    console.print(
        f"[dim]{result.traces} traces (a doubling-and-bisection finder would run "
        f"{result.bisection_traces} trials). Sizes in {units} units.[/dim]"
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
    all_gpus, traces = answer.judged_every_gpu, answer.traces
    fmt = lambda n: format_bytes(n, units)  # noqa: E731
    console = Console()
    base = result.baseline
    console.print(
        f"[bold]{base.model.name}[/bold]: device total {fmt(base.peak.device_total_bytes)}"
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
    for column in ("lever", "flags", "device total", "saves", "status", "cost"):
        table.add_column(column, justify="right" if column in ("device total", "saves") else "left")
    for lever in result.levers:
        cost = ", ".join(
            f"{k.replace('_', ' ')}: {v:.0%}"
            if isinstance(v, float)
            else f"{k.replace('_', ' ')}: {v}"
            for k, v in lever.cost.items()
        )
        table.add_row(
            lever.name,
            lever.flags,
            fmt(lever.estimate.peak.device_total_bytes),
            saves(lever, units),
            lever.status.upper(),
            cost,
        )
    console.print(table)
    if result.plan is not None:
        plan = result.plan
        console.print(
            f"First plan that fits: [bold]{plan.name}[/bold] → {plan.flags} "
            f"(device total {fmt(plan.estimate.peak.device_total_bytes)}, "
            f"{plan.status.upper()})"
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
    console.print(f"[dim]{traces} traces. Sizes in {units} units.[/dim]")
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
