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
    DpOpt,
    FrameworkOpt,
    FsdpOpt,
    GpuMemoryOpt,
    GpuOpt,
    GradAccum,
    HeadroomOpt,
    HtmlOpt,
    InputShape,
    JsonOpt,
    MicrobatchesOpt,
    Model,
    ModeOpt,
    OffloadOptimizerOpt,
    OffloadParamsOpt,
    OptimizerOpt,
    PlotOpt,
    PpOpt,
    PrecisionOpt,
    ProfileOpt,
    ReshardOpt,
    SeqLen,
    ShardOpt,
    SpOpt,
    TargetOpt,
    TpOpt,
    UnitsOpt,
    WorldSizeOpt,
    ZeroOpt,
    recipe_from_options,
)
from vramplan.distributed.facts import facts_of
from vramplan.distributed.fsdp import engine_for, with_traced_layout
from vramplan.distributed.layout import ParallelLayout, check_layout, per_rank
from vramplan.distributed.options import layout_from_flags
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
    fsdp: FsdpOpt = None,
    world_size: WorldSizeOpt = None,
    shard: ShardOpt = "full",
    reshard_after_forward: ReshardOpt = True,
    zero: ZeroOpt = None,
    dp: DpOpt = None,
    offload_optimizer: OffloadOptimizerOpt = False,
    offload_params: OffloadParamsOpt = False,
    tp: TpOpt = 1,
    sp: SpOpt = False,
    pp: PpOpt = 1,
    microbatches: MicrobatchesOpt = 1,
    json_output: JsonOpt = False,
    units: UnitsOpt = "binary",
) -> int:
    """Trace one training (or inference) step with fake tensors and break down its peak."""
    if framework not in ("pytorch", "tensorflow"):
        raise UserError(f"unknown framework {framework!r}; choose pytorch or tensorflow")
    if target not in ("cuda", "cpu"):
        raise UserError(f"unknown target {target!r}; choose cuda or cpu")
    recipe = recipe_from_options(locals())
    layout = layout_from_flags(
        fsdp=fsdp,
        world_size=world_size,
        shard=shard,
        reshard_after_forward=reshard_after_forward,
        zero=zero,
        dp=dp,
        offload_optimizer=offload_optimizer,
        offload_params=offload_params,
        tp=tp,
        sp=sp,
        pp=pp,
        microbatches=microbatches,
    )
    engine = engine_for(layout)
    device = device_options(gpu, gpu_memory, headroom, alloc_conf, cudnn_benchmark,
                            data_parallel=layout.data_parallel if engine else 1, profile=profile)
    built = resolve(model, recipe)
    facts = facts_of(built) if layout != ParallelLayout() else None
    if facts is not None:
        check_layout(layout, facts)
    result = estimate_built(built, recipe, target, device, engine=engine)
    if engine is not None:
        result = with_traced_layout(result, layout)
    elif facts is not None:
        result = per_rank(result, layout, facts)
    if framework == "tensorflow":
        result = result.with_changes(notes=(*result.notes, TENSORFLOW_NOTE))
    if html:

        def at(batch: int):
            changed = recipe.with_changes(batch_size=batch)
            return estimate_built(resolve(model, changed), changed, target, device)

        curve = batch_curve_for(result, at)
    write_reports(result, html=html, plot=plot, units=units, batch_curve=curve if html else None)
    return emit(result, json_output=json_output, units=units)
