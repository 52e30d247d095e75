"""``vramplan calc``, ``vramplan layers`` and ``vramplan llm``: answers without tracing.

$ vramplan calc --params 20M --batch-size 32 --activations-per-sample 1M --optimizer none
$ vramplan layers examples/vgg16.yaml --method cs231n
$ vramplan llm hf:meta-llama-3-8b --seq-len 4096 --precision amp-bf16
"""

from __future__ import annotations

from typing import Annotated

import typer

import vramplan
from vramplan.cli.app import app
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
from vramplan.report.analytic import render_layers
from vramplan.report.render import emit

MethodOpt = Annotated[
    str,
    typer.Option(
        "--method", help="pytorch (what PyTorch keeps, default) | cs231n (the course's recipe)."
    ),
]


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
    estimate = vramplan.calc(
        params,
        activations_per_sample=activations_per_sample,
        batch_size=batch_size,
        input_shape=input_shape,
        precision=precision,
        optimizer=optimizer,
        mode=mode,
        method=method,
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
    estimate = vramplan.layers(
        spec,
        batch_size=batch_size,
        precision=precision,
        optimizer=optimizer,
        mode=mode,
        method=method,
    )
    if not json_output:
        render_layers(estimate, units)
    return emit(estimate, json_output=json_output, units=units)


@app.command("llm")
def llm_command(
    model: Annotated[str, typer.Argument(help="hf:NAME or hf:path/config.json (decoder-only).")],
    batch_size: BatchSize = 1,
    seq_len: SeqLen = None,
    precision: Annotated[
        str | None,
        typer.Option(
            "--precision", "-p", help="As for estimate; default amp-bf16 (estimate's is fp32)."
        ),
    ] = None,
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
    lora_rank: Annotated[
        int, typer.Option("--lora", "--lora-rank", help="Train LoRA adapters of this rank.")
    ] = 0,
    qlora: Annotated[bool, typer.Option("--qlora", help="4-bit NF4 frozen base (QLoRA).")] = False,
    json_output: JsonOpt = False,
    units: UnitsOpt = "binary",
) -> int:
    """Transformer formulas from a config: no model is built, answers in microseconds."""
    estimate = vramplan.llm(
        model,
        batch_size=batch_size,
        seq_len=seq_len,
        precision=precision,
        optimizer=optimizer,
        mode=mode,
        attention=attention,
        recompute=recompute,
        tp=tp,
        sp=sp,
        lora_rank=lora_rank,
        qlora=qlora,
    )
    return emit(estimate, json_output=json_output, units=units)
