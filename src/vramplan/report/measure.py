"""The terminal rendering of ``measure`` (estimate beside measurement, leak check) and its
table for the HTML report.

    render_comparison(session.measure(batch_size=8, device="cpu"), "binary")
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from vramplan.units import format_bytes

if TYPE_CHECKING:
    from vramplan.measurement.compare import Comparison


def comparison_rows(result: Comparison, units: str) -> list[list[str]]:
    """Header and rows of estimate vs measurement, for the HTML report."""
    rows = [["figure", "estimate", "measured", "error"]]
    for name, (estimate, real) in result.pairs().items():
        if real is not None and estimate is not None:
            rows.append(
                [
                    name,
                    format_bytes(estimate, units),
                    format_bytes(real, units),
                    f"{result.errors.get(name, 0.0):+.1%}",
                ]
            )
    return rows


def render_comparison(result: Comparison, units: str) -> None:
    fmt = lambda n: format_bytes(n, units) if n is not None else "-"  # noqa: E731
    console = Console()
    measured, est = result.measured, result.estimate
    console.print(f"[bold]{est.model.name}[/bold] on {measured.device}, {measured.steps} steps")
    table = Table(title="Estimate vs measurement", title_justify="left")
    for column in ("figure", "estimate", "measured", "error"):
        table.add_column(column, justify="left" if column == "figure" else "right")
    labels = {
        "allocated": "allocated (peak)",
        "reserved": "reserved (peak)",
        "device_total": f"device total ({est.details.get('used_counter', 'nvml-v1')})",
    }
    for name, (estimate, real) in result.pairs().items():
        if real is None:
            continue
        label, error = labels[name], result.errors.get(name)
        table.add_row(
            label, fmt(estimate), fmt(real), f"{error:+.1%}" if error is not None else "-"
        )
    console.print(table)
    if measured.oom:
        console.print(
            f"[bold red]out of memory[/bold red] in {measured.oom['phase']} of step "
            f"{measured.oom['step']}: {measured.oom['error']}"
        )
    leak = result.leak
    after = ", ".join(fmt(v) for v in leak.after_step_bytes)
    verdict = (
        "[bold red]LEAK[/bold red]: memory grows by "
        f"{fmt(leak.bytes_per_step)} per step after the optimizer state exists"
        if leak.leaking
        else "no leak: memory is flat once the optimizer state exists"
    )
    console.print(f"Live memory after each step: {after} — {verdict}")
    if measured.snapshot:
        console.print(
            f"Snapshot written to {measured.snapshot} (open it at pytorch.org/memory_viz)"
        )
    console.print(f"[dim]Sizes in {units} units.[/dim]")
