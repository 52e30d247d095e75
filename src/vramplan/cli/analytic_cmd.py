"""``vramplan calc``, ``vramplan layers`` and ``vramplan llm``: answers without tracing.

$ vramplan calc --params 20M --batch-size 32 --activations-per-sample 1M --optimizer none
$ vramplan layers examples/vgg16.yaml --method cs231n
$ vramplan llm hf:meta-llama-3-8b --seq-len 4096 --precision amp-bf16
"""

from __future__ import annotations

from typing import Annotated

import typer

from vramplan.analytic.calc import METHODS, calculate
from vramplan.analytic.layers import layers_estimate, load_spec
from vramplan.analytic.transformer import LoRA, Parallelism, transformer_estimate
from vramplan.cli import app
from vramplan.cli.options import (
    BatchSize,
    InputShape,
    JsonOpt,
    ModeOpt,
    OptimizerOpt,
    PrecisionOpt,
    SeqLen,
    UnitsOpt,
)
from vramplan.errors import UserError
from vramplan.report.render import emit
from vramplan.sources.hf import load_config_dict
from vramplan.units import parse_count
from vramplan.workload import Recipe, parse_shape

MethodOpt = Annotated[
    str,
    typer.Option(
        "--method", help="pytorch (what PyTorch keeps, default) | cs231n (the course's recipe)."
    ),
]


def _method(method: str) -> str:
    if method not in METHODS:
        raise UserError(f"unknown method {method!r}; choose pytorch or cs231n")
    return method


@app.command("calc")
def calc_command(
    params: Annotated[str, typer.Option("--params", help="Parameter count: 20M, 1.3B, 2e7.")],
    activations_per_sample: Annotated[
        str,
        typer.Option("--activations-per-sample", help="Activation values per sample (forward)."),
    ] = "0",
    batch_size: BatchSize = 1,
    input_shape: InputShape = None,
    precision: PrecisionOpt = "fp32",
    optimizer: OptimizerOpt = "adamw",
    mode: ModeOpt = "train",
    method: MethodOpt = "pytorch",
    json_output: JsonOpt = False,
    units: UnitsOpt = "binary",
) -> int:
    """The classic arithmetic: parameters, gradients, optimizer state and activations."""
    recipe = Recipe(batch_size=batch_size, precision=precision, optimizer=optimizer, mode=mode)
    estimate = calculate(
        parse_count(params, "parameter count"),
        batch_size,
        parse_count(activations_per_sample, "activations per sample"),
        recipe,
        _method(method),
        parse_shape(input_shape) if input_shape else None,
    )
    return emit(estimate, json_output=json_output, units=units)


@app.command("layers")
def layers_command(
    spec: Annotated[str, typer.Argument(help="A YAML or JSON layer spec.")],
    batch_size: BatchSize = 1,
    precision: PrecisionOpt = "fp32",
    optimizer: OptimizerOpt = "adamw",
    mode: ModeOpt = "train",
    method: MethodOpt = "pytorch",
    json_output: JsonOpt = False,
    units: UnitsOpt = "binary",
) -> int:
    """Propagate shapes through a table of layers and count parameters and activations."""
    recipe = Recipe(batch_size=batch_size, precision=precision, optimizer=optimizer, mode=mode)
    estimate = layers_estimate(load_spec(spec), recipe, _method(method), name=spec)
    if not json_output:
        _print_layers(estimate, units)
    return emit(estimate, json_output=json_output, units=units)


def _print_layers(estimate, units: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from vramplan.units import format_bytes

    table = Table(title="Layers (per sample)", title_justify="left")
    for column in ("#", "type", "output", "parameters", "activations", "saved"):
        table.add_column(column, justify="left" if column in ("type", "output") else "right")
    for row in estimate.details["layers"]:
        table.add_row(
            str(row["index"]),
            row["type"],
            "x".join(map(str, row["output_shape"])),
            f"{row['parameters']:,}",
            f"{row['activation_values']:,}",
            format_bytes(row["saved_bytes_per_sample"], units),
        )
    Console().print(table)
    values = estimate.details["activation_values_per_sample"]
    Console().print(
        f"Total: {estimate.model.parameters:,} parameters, {values:,} activation "
        "values per sample (input included)"
    )


@app.command("llm")
def llm_command(
    model: Annotated[str, typer.Argument(help="hf:NAME or hf:path/config.json (decoder-only).")],
    batch_size: BatchSize = 1,
    seq_len: SeqLen = None,
    precision: PrecisionOpt = "amp-bf16",
    optimizer: OptimizerOpt = "adamw",
    mode: ModeOpt = "train",
    attention: Annotated[
        str,
        typer.Option(
            "--attention", help="flash (memory-efficient SDPA, default) | eager (keeps s² scores)."
        ),
    ] = "flash",
    recompute: Annotated[
        str,
        typer.Option(
            "--recompute", help="none | selective (attention scores) | full (layer inputs only)."
        ),
    ] = "none",
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel degree.")] = 1,
    sp: Annotated[bool, typer.Option("--sp", help="Sequence parallelism with --tp.")] = False,
    lora_rank: Annotated[int, typer.Option("--lora-rank", help="Train LoRA adapters.")] = 0,
    qlora: Annotated[bool, typer.Option("--qlora", help="4-bit NF4 frozen base (QLoRA).")] = False,
    json_output: JsonOpt = False,
    units: UnitsOpt = "binary",
) -> int:
    """Transformer formulas from a config: no model is built, answers in microseconds."""
    if attention not in ("flash", "eager"):
        raise UserError(f"unknown attention {attention!r}; choose flash or eager")
    if recompute not in ("none", "selective", "full"):
        raise UserError(f"unknown recompute {recompute!r}; choose none, selective or full")
    if lora_rank < 0 or (qlora and lora_rank == 0):
        raise UserError("--qlora needs --lora-rank R (a positive rank)")
    prefix, _, name = model.partition(":")
    if prefix != "hf" or not name:
        raise UserError(f"llm takes hf:NAME or hf:path/config.json, got {model!r}")
    label, config = load_config_dict(name)
    recipe = Recipe(
        batch_size=batch_size, seq_len=seq_len, precision=precision, optimizer=optimizer, mode=mode
    )
    estimate = transformer_estimate(
        config,
        recipe,
        f"hf:{label}",
        flash=attention == "flash",
        parallel=Parallelism(tp, sp),
        recompute=recompute,
        lora=LoRA(lora_rank, 4 if qlora else 16) if lora_rank else None,
    )
    return emit(estimate, json_output=json_output, units=units)
