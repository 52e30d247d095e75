"""``vramplan measure``: run the step for real and put it beside the estimate.

$ vramplan measure torchvision:resnet18 --batch-size 8
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from vramplan.cli import app
from vramplan.cli.options import (
    AllocConfOpt,
    BatchSize,
    CheckpointingOpt,
    GradAccum,
    HtmlOpt,
    InputShape,
    JsonOpt,
    Model,
    ModeOpt,
    OptimizerOpt,
    PlotOpt,
    PrecisionOpt,
    SeqLen,
    UnitsOpt,
    recipe_from_options,
)
from vramplan.compare import Comparison, measure_and_compare
from vramplan.report.outputs import write_reports
from vramplan.report.render import check_units
from vramplan.units import format_bytes

StepsOpt = Annotated[
    int, typer.Option("--steps", help="Real steps to run (3 or more for the leak check).")
]
DeviceOpt = Annotated[
    str | None, typer.Option("--device", help="cuda | cpu (default: cuda when available).")
]
SnapshotOpt = Annotated[
    str | None,
    typer.Option(
        "--snapshot", help="CUDA only: write a memory snapshot for pytorch.org/memory_viz."
    ),
]


@app.command("measure")
def measure_command(
    model: Model,
    batch_size: BatchSize = 1,
    seq_len: SeqLen = None,
    input_shape: InputShape = None,
    precision: PrecisionOpt = "fp32",
    optimizer: OptimizerOpt = "adamw",
    checkpointing: CheckpointingOpt = "none",
    grad_accum: GradAccum = 1,
    mode: ModeOpt = "train",
    steps: StepsOpt = 3,
    device: DeviceOpt = None,
    snapshot: SnapshotOpt = None,
    alloc_conf: AllocConfOpt = None,
    html: HtmlOpt = None,
    plot: PlotOpt = None,
    json_output: JsonOpt = False,
    units: UnitsOpt = "binary",
) -> int:
    """Run N real steps, measure memory, and print estimate vs measurement and a leak check."""
    check_units(units)
    recipe = recipe_from_options(locals())
    result = measure_and_compare(model, recipe, device, steps, snapshot, alloc_conf)
    if html or plot:
        write_reports(
            result.estimate,
            html=html,
            plot=plot,
            units=units,
            measurement=comparison_rows(result, units),
        )
    if json_output:
        json.dump(result.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        render_comparison(result, units)
    return 0


def comparison_rows(result: Comparison, units: str) -> list[list[str]]:
    """Header and rows of estimate vs measurement, for the HTML report."""
    peak, measured = result.estimate.peak, result.measured
    rows = [["figure", "estimate", "measured", "error"]]
    for name, estimate, real in (
        ("allocated", peak.allocated_bytes, measured.allocated_bytes),
        ("reserved", peak.reserved_bytes, measured.reserved_bytes),
        ("device_total", peak.device_total_bytes, measured.device_total_bytes),
    ):
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
    rows = [
        ("allocated (peak)", est.peak.allocated_bytes, measured.allocated_bytes),
        ("reserved (peak)", est.peak.reserved_bytes, measured.reserved_bytes),
        ("device total", est.peak.device_total_bytes, measured.device_total_bytes),
    ]
    names = dict(
        zip(
            ("allocated (peak)", "reserved (peak)", "device total"),
            ("allocated", "reserved", "device_total"),
            strict=True,
        )
    )
    for label, estimate, real in rows:
        if real is None:
            continue
        error = result.errors.get(names[label])
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
