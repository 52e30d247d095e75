"""``vramplan plan`` and ``vramplan max-batch``: what fits, and what to change when it does not.

$ vramplan max-batch torchvision:resnet50 --gpu t4
$ vramplan plan hf:meta-llama-3-8b --seq-len 4096 --batch-size 8 --gpu a100-80gb
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from vramplan.api import device_options
from vramplan.cli import app
from vramplan.cli.options import (
    AllocConfOpt,
    BatchSize,
    CheckpointingOpt,
    GpuMemoryOpt,
    GpuOpt,
    GradAccum,
    HeadroomOpt,
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
from vramplan.distributed.facts import facts_of
from vramplan.distributed.needed import gpus_needed, host_state_bytes
from vramplan.errors import UserError
from vramplan.gpus import catalog
from vramplan.plan.bench import Workbench
from vramplan.plan.fleet import gpus_that_fit
from vramplan.plan.host import HostOptions, host_memory
from vramplan.plan.levers import plan_levers
from vramplan.plan.search import largest_fitting
from vramplan.plan.sharded import traced_answer
from vramplan.report.outputs import batch_curve_for, write_reports
from vramplan.report.render import check_units
from vramplan.sources import resolve
from vramplan.units import format_bytes, parse_bytes

SearchOpt = Annotated[str, typer.Option("--search", help="batch-size | seq-len")]
HostMemoryOpt = Annotated[
    str | None,
    typer.Option("--host-memory", help="System RAM to check the run against, e.g. 64GiB."),
]
WorkersOpt = Annotated[int, typer.Option("--workers", help="DataLoader worker processes.")]
OffloadOpt = Annotated[
    bool,
    typer.Option("--offload-optimizer", help="Count the optimizer state as offloaded to the host."),
]


@app.command("max-batch")
def max_batch_command(
    model: Model,
    gpu: GpuOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    search: SearchOpt = "batch-size",
    batch_size: BatchSize = 1,
    seq_len: SeqLen = None,
    input_shape: InputShape = None,
    precision: PrecisionOpt = "fp32",
    optimizer: OptimizerOpt = "adamw",
    checkpointing: CheckpointingOpt = "none",
    grad_accum: GradAccum = 1,
    mode: ModeOpt = "train",
    headroom: HeadroomOpt = 0.10,
    alloc_conf: AllocConfOpt = None,
    json_output: JsonOpt = False,
    units: UnitsOpt = "binary",
) -> int:
    """The largest batch (or --search seq-len: the longest context) that fits the card."""
    check_units(units)
    knob = {"batch-size": "batch_size", "seq-len": "seq_len"}.get(search)
    if knob is None:
        raise UserError(f"unknown search {search!r}; choose batch-size or seq-len")
    recipe = recipe_from_options(locals())
    bench = Workbench(model, device_options(gpu, gpu_memory, headroom, alloc_conf))
    result = largest_fitting(bench, recipe, knob, start=seq_len if knob == "seq_len" else None)
    if json_output:
        json.dump(result.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    fmt = lambda n: format_bytes(n, units)  # noqa: E731
    est = result.estimate
    label = "batch size" if knob == "batch_size" else "sequence length"
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
    return 0


@app.command("plan")
def plan_command(
    model: Model,
    gpu: GpuOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    batch_size: BatchSize = 1,
    seq_len: SeqLen = None,
    input_shape: InputShape = None,
    precision: PrecisionOpt = "fp32",
    optimizer: OptimizerOpt = "adamw",
    checkpointing: CheckpointingOpt = "none",
    grad_accum: GradAccum = 1,
    mode: ModeOpt = "train",
    headroom: HeadroomOpt = 0.10,
    alloc_conf: AllocConfOpt = None,
    host_memory_limit: HostMemoryOpt = None,
    workers: WorkersOpt = 4,
    offload_optimizer: OffloadOpt = False,
    html: HtmlOpt = None,
    plot: PlotOpt = None,
    json_output: JsonOpt = False,
    units: UnitsOpt = "binary",
) -> int:
    """Rank the levers that cut memory and give the first plan that fits; without --gpu,
    judge every catalog GPU."""
    check_units(units)
    recipe = recipe_from_options(locals())
    all_gpus = gpu is None and gpu_memory is None
    card = "A100-80GB" if all_gpus else gpu
    bench = Workbench(model, device_options(card, gpu_memory, headroom, alloc_conf))
    result = plan_levers(bench, recipe)
    limit = parse_bytes(host_memory_limit, "host memory") if host_memory_limit else None
    needed, needed_note = None, ""
    if not all_gpus and result.baseline.verdict.status != "fits" and result.plan is None:
        needed, needed_note = _gpus_needed(bench, model, recipe, limit)
    options = [*result.levers, *([result.plan] if result.plan else [])]
    fleet = gpus_that_fit(bench, recipe, options, catalog() if all_gpus else (bench.device.card,))
    host = host_memory(
        result.baseline,
        HostOptions(workers=workers, limit_bytes=limit, offload_optimizer=offload_optimizer),
        result.baseline.details.get("optimizer_state_bytes"),
    )
    _write_plan_reports(result, bench, recipe, html, plot, units)
    if json_output:
        data = result.to_json()
        data["gpus"] = [row.to_json() for row in fleet]
        data["host"] = host.to_json()
        data["traces"] = bench.traces
        data["gpus_needed"] = ({**needed.to_json(), "with": needed_note} if needed else
                               {"answer": None, "why": needed_note} if needed_note else None)
        json.dump(data, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    _render(result, fleet, host, all_gpus, units, bench.traces)
    if needed is not None:
        rank = format_bytes(needed.estimate.peak.device_total_bytes, units)
        offloaded_bytes = host_state_bytes(needed.estimate)
        offloaded = (f"; offloaded state on the host: {format_bytes(offloaded_bytes, units)}"
                     if offloaded_bytes else "")
        Console().print(
            f"Needs [bold]{needed.gpus} x {result.baseline.verdict.gpu}[/bold] with "
            f"[bold]{needed.layout.describe()}[/bold] {needed_note}: {rank} per GPU, "
            f"{needed.estimate.verdict.status.upper()}{offloaded}"
        )
    elif needed_note:
        Console().print(f"[bold red]No layout fits:[/bold red] {needed_note}")
    return 0


def _gpus_needed(bench: Workbench, model: str, recipe, host_limit: int | None):
    """GPUs needed as the recipe stands; failing that, with full checkpointing. An FSDP
    answer is then traced through FSDP2 itself; offload that overflows ``host_limit`` is
    not an answer."""
    facts = facts_of(resolve(model, recipe))
    try:
        answer = gpus_needed(bench.estimate(recipe), facts, host_limit)
        return traced_answer(bench, answer, recipe), ""
    except UserError as exc:
        if recipe.checkpointing == "full" or not recipe.is_training:
            return None, str(exc)
    checkpointed = recipe.with_changes(checkpointing="full")
    try:
        answer = gpus_needed(bench.estimate(checkpointed), facts, host_limit)
        return traced_answer(bench, answer, checkpointed), "with --checkpointing full"
    except UserError as exc:
        return None, str(exc)


def _write_plan_reports(result, bench, recipe, html, plot, units: str) -> None:
    if not html and not plot:
        return
    fmt = lambda n: format_bytes(n, units)  # noqa: E731
    rows = [["lever", "flags", "device total", "saves", "status"]]
    rows += [
        [
            lever.name,
            lever.flags,
            fmt(lever.estimate.peak.device_total_bytes),
            fmt(lever.saved_bytes),
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
                fmt(result.plan.saved_bytes),
                result.plan.status.upper(),
            ]
        )
    curve = (
        batch_curve_for(
            result.baseline, lambda b: bench.estimate(recipe.with_changes(batch_size=b))
        )
        if html
        else None
    )
    write_reports(result.baseline, html=html, plot=plot, units=units, batch_curve=curve, plan=rows)


def _render(result, fleet, host, all_gpus: bool, units: str, traces: int) -> None:
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
            fmt(lever.saved_bytes),
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
