"""``vramplan check``: does this job fit the card? One line, exit 0 (fits) or 3 (tight or
out of memory), for launchers and CI::

$ vramplan check --config qlora.yaml --gpu a10g && python train.py
$ vramplan check hf:meta-llama-3-8b --config ds_config.json --gpu h100 --json
"""

from __future__ import annotations

from typing import Annotated

import typer

from vramplan import UserError
from vramplan.cli.app import app
from vramplan.cli.config_options import ConfigOpt, OptionalModel, config_lines, with_config
from vramplan.cli.options import (
    FINETUNING,
    LAYOUT,
    AllocConfOpt,
    BatchSize,
    CheckpointingOpt,
    CudnnBenchmarkOpt,
    FrameworkOpt,
    GpuMemoryOpt,
    GpuOpt,
    GradAccum,
    HeadroomOpt,
    InputShape,
    JsonOpt,
    ModeOpt,
    OptimizerOpt,
    PrecisionOpt,
    ProfileOpt,
    QuietOpt,
    SeqLen,
    StackOpt,
    TargetOpt,
    TimeoutOpt,
    UnitsOpt,
    UsedCounterOpt,
    layout_from_options,
    recipe_from_options,
    session_from_options,
    with_options,
)
from vramplan.report.check import check_exit_code, check_json, check_line
from vramplan.report.progress import progress_wanted, trace_progress
from vramplan.report.render import check_units, print_json


@app.command("check")
@with_options(*FINETUNING, LAYOUT)
def check_command(
    ctx: typer.Context,
    model: OptionalModel = None,
    config: ConfigOpt = None,
    batch_size: BatchSize = 1,
    seq_len: SeqLen = None,
    input_shape: InputShape = None,
    precision: PrecisionOpt = "fp32",
    optimizer: OptimizerOpt = "adamw",
    checkpointing: CheckpointingOpt = "none",
    grad_accum: GradAccum = 1,
    mode: ModeOpt = "train",
    target: TargetOpt = "cuda",
    gpu: GpuOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    headroom: HeadroomOpt = 0.10,
    alloc_conf: AllocConfOpt = None,
    cudnn_benchmark: CudnnBenchmarkOpt = False,
    stack: StackOpt = None,
    used_counter: UsedCounterOpt = "nvml-v1",
    framework: FrameworkOpt = "pytorch",
    profile: ProfileOpt = None,
    timeout: TimeoutOpt = 300.0,
    json_output: JsonOpt = False,
    units: UnitsOpt = "binary",
    full_trace: Annotated[
        bool,
        typer.Option(
            "--full-trace",
            help="Trace every block and both training iterations, instead of tracing a run "
            "of identical blocks once and repeating it (hf: and diffusers: models) and "
            "copying the second iteration's passes from the first (the defaults, each used "
            "only where it is exact).",
        ),
    ] = False,
    quiet: QuietOpt = False,
    **shared,
) -> int:
    """Exit 0 when the step fits the card with its headroom free, 3 when it does not (one
    line; --json for the verdict as an object). Needs --gpu or --gpu-memory."""
    check_units(units)
    if gpu is None and gpu_memory is None:
        raise UserError("check needs a card: --gpu NAME or --gpu-memory SIZE")
    options, training_config = with_config({**locals(), **shared}, ctx)
    recipe = recipe_from_options(options)
    layout = layout_from_options(options)
    with trace_progress(progress_wanted(json_output, quiet)) as progress:
        session = session_from_options(options, progress=progress)
        result = session.estimate(recipe, layout=layout)
    lines = config_lines(training_config, options)
    if json_output:
        print_json(check_json(result, lines))
    else:
        print(check_line(result, units))
    return check_exit_code(result.verdict.status)
