"""``vramplan estimate``: trace one step and explain its memory.

    $ vramplan estimate torchvision:resnet50 --batch-size 64 --gpu a100
"""

from __future__ import annotations

from vramplan.api import device_options, estimate_built
from vramplan.cli import app
from vramplan.cli.options import (
    AllocConfOpt,
    BatchSize,
    CheckpointingOpt,
    CudnnBenchmarkOpt,
    FrameworkOpt,
    GpuMemoryOpt,
    GpuOpt,
    GradAccum,
    HeadroomOpt,
    HtmlOpt,
    InputShape,
    JsonOpt,
    ModeOpt,
    Model,
    OptimizerOpt,
    PlotOpt,
    PrecisionOpt,
    ProfileOpt,
    SeqLen,
    TargetOpt,
    UnitsOpt,
    recipe_from_options,
)
from vramplan.errors import UserError
from vramplan.report.outputs import batch_curve_for, write_reports
from vramplan.report.render import emit
from vramplan.sources import resolve

TENSORFLOW_NOTE = (
    "TensorFlow reserves nearly the whole card at start-up unless memory growth is on "
    "(tf.config.experimental.set_memory_growth); nvidia-smi then shows the card as full "
    "whatever the model needs. This estimate is the PyTorch step's memory."
)


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
    gpu: GpuOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    headroom: HeadroomOpt = 0.10,
    alloc_conf: AllocConfOpt = None,
    cudnn_benchmark: CudnnBenchmarkOpt = False,
    framework: FrameworkOpt = "pytorch",
    profile: ProfileOpt = None,
    html: HtmlOpt = None,
    plot: PlotOpt = None,
    json_output: JsonOpt = False,
    units: UnitsOpt = "binary",
) -> int:
    """Trace one training (or inference) step with fake tensors and break down its peak."""
    if framework not in ("pytorch", "tensorflow"):
        raise UserError(f"unknown framework {framework!r}; choose pytorch or tensorflow")
    if target not in ("cuda", "cpu"):
        raise UserError(f"unknown target {target!r}; choose cuda or cpu")
    recipe = recipe_from_options(
        batch_size=batch_size, seq_len=seq_len, input_shape=input_shape, precision=precision,
        optimizer=optimizer, checkpointing=checkpointing, grad_accum=grad_accum, mode=mode,
    )
    device = device_options(gpu, gpu_memory, headroom, alloc_conf, cudnn_benchmark,
                            profile=profile)
    result = estimate_built(resolve(model, recipe), recipe, target, device)
    if framework == "tensorflow":
        result = result.with_changes(notes=(*result.notes, TENSORFLOW_NOTE))
    if html:
        def at(batch: int):
            changed = recipe.with_changes(batch_size=batch)
            return estimate_built(resolve(model, changed), changed, target, device)

        curve = batch_curve_for(result, at)
    write_reports(result, html=html, plot=plot, units=units,
                  batch_curve=curve if html else None)
    return emit(result, json_output=json_output, units=units)
