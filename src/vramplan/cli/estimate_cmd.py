"""``vramplan estimate``: trace one step and explain its memory.

    $ vramplan estimate torchvision:resnet50 --batch-size 64
"""

from __future__ import annotations

from vramplan.api import estimate_built
from vramplan.cli import app
from vramplan.cli.options import (
    BatchSize, CheckpointingOpt, GradAccum, InputShape, JsonOpt, ModeOpt, Model, OptimizerOpt,
    PrecisionOpt, SeqLen, TargetOpt, UnitsOpt, recipe_from_options,
)
from vramplan.report.render import emit
from vramplan.sources import resolve


@app.command("estimate")
def estimate_command(
    model: Model,
    batch_size: BatchSize = 1,
    seq_len: SeqLen = None,
    input_shape: InputShape = None,
    precision: PrecisionOpt = "fp32",
    optimizer: OptimizerOpt = "adamw",
    checkpointing: CheckpointingOpt = "none",
    grad_accum: GradAccum = 1,
    mode: ModeOpt = "train",
    target: TargetOpt = "cuda",
    json_output: JsonOpt = False,
    units: UnitsOpt = "binary",
) -> int:
    """Trace one training (or inference) step with fake tensors and break down its peak."""
    recipe = recipe_from_options(
        batch_size=batch_size, seq_len=seq_len, input_shape=input_shape, precision=precision,
        optimizer=optimizer, checkpointing=checkpointing, grad_accum=grad_accum, mode=mode,
    )
    result = estimate_built(resolve(model, recipe), recipe, target)
    return emit(result, json_output=json_output, units=units)
