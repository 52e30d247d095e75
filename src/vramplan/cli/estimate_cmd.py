"""``vramplan estimate``: trace one step and explain its memory.

$ vramplan estimate torchvision:resnet50 --batch-size 64 --gpu a100
"""

from __future__ import annotations

from typing import Annotated

import typer

from vramplan.cli.app import app
from vramplan.cli.config_options import ConfigOpt, OptionalModel, config_lines, with_config
from vramplan.cli.options import (
    FINETUNING,
    LAYOUT,
    AllocConfOpt,
    AllowCustomObjectsOpt,
    AttentionOpt,
    BackboneNormOpt,
    BatchSize,
    BoxesPerImageOpt,
    BusiestImageBoxesOpt,
    CacheOpt,
    CheckpointingOpt,
    CudnnBenchmarkOpt,
    DetectionCountsOpt,
    DiffusionEncodersOpt,
    ExpertsOpt,
    FocalLossOpt,
    FramesOpt,
    FrameworkOpt,
    GpuMemoryOpt,
    GpuOpt,
    GradAccum,
    HeadroomOpt,
    HtmlOpt,
    InputShape,
    JsonOpt,
    KvBitsOpt,
    KvGroupSizeOpt,
    KvResidualOpt,
    ModeOpt,
    MoeRoutingOpt,
    NewTokensOpt,
    NumBeamsOpt,
    NumClassesOpt,
    OptimizerImplOpt,
    OptimizerOpt,
    PlotOpt,
    PrecisionOpt,
    ProfileOpt,
    PromptLenOpt,
    QuietOpt,
    ResolutionOpt,
    SeqLen,
    StackOpt,
    TargetLenOpt,
    TargetOpt,
    TargetsOnGpuOpt,
    TfMemoryGrowthOpt,
    TfMemoryLimitOpt,
    TimeoutOpt,
    TrustRemoteCodeOpt,
    UnitsOpt,
    UsedCounterOpt,
    ZeroGradOpt,
    layout_from_options,
    recipe_from_options,
    session_from_options,
    with_options,
)
from vramplan.report.outputs import (
    batch_curve_for,
    check_report_paths,
    curve_sizes,
    write_reports,
)
from vramplan.report.progress import progress_wanted, trace_progress
from vramplan.report.render import check_units, emit


@app.command("estimate")
@with_options(*FINETUNING, LAYOUT)
def estimate_command(
    ctx: typer.Context,
    model: OptionalModel = None,
    config: ConfigOpt = None,
    batch_size: BatchSize = 1,
    seq_len: SeqLen = None,
    input_shape: InputShape = None,
    precision: PrecisionOpt = "fp32",
    optimizer: OptimizerOpt = "adamw",
    optimizer_impl: OptimizerImplOpt = "auto",
    checkpointing: CheckpointingOpt = "none",
    grad_accum: GradAccum = 1,
    zero_grad: ZeroGradOpt = "auto",
    mode: ModeOpt = "train",
    prompt_len: PromptLenOpt = None,
    new_tokens: NewTokensOpt = None,
    cache: CacheOpt = "dynamic",
    num_beams: NumBeamsOpt = 1,
    kv_bits: KvBitsOpt = None,
    kv_group_size: KvGroupSizeOpt = None,
    kv_residual_length: KvResidualOpt = None,
    boxes_per_image: BoxesPerImageOpt = 20,
    busiest_image_boxes: BusiestImageBoxesOpt = None,
    detection_counts: DetectionCountsOpt = "max",
    targets_on_gpu: TargetsOnGpuOpt = "model",
    backbone_norm: BackboneNormOpt = "frozen",
    focal_loss: FocalLossOpt = "ops",
    resolution: ResolutionOpt = None,
    frames: FramesOpt = None,
    diffusion_encoders: DiffusionEncodersOpt = "precomputed",
    attention: AttentionOpt = None,
    moe_routing: MoeRoutingOpt = "balanced",
    experts: ExpertsOpt = None,
    target_len: TargetLenOpt = None,
    num_classes: NumClassesOpt = None,
    target: TargetOpt = "cuda",
    gpu: GpuOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    headroom: HeadroomOpt = 0.10,
    alloc_conf: AllocConfOpt = None,
    cudnn_benchmark: CudnnBenchmarkOpt = False,
    stack: StackOpt = None,
    used_counter: UsedCounterOpt = "nvml-v1",
    framework: FrameworkOpt = "pytorch",
    tf_memory_growth: TfMemoryGrowthOpt = False,
    tf_memory_limit: TfMemoryLimitOpt = None,
    allow_custom_objects: AllowCustomObjectsOpt = False,
    profile: ProfileOpt = None,
    html: HtmlOpt = None,
    plot: PlotOpt = None,
    timeout: TimeoutOpt = 300.0,
    trust_remote_code: TrustRemoteCodeOpt = False,
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
    """Trace one training (or inference) step with fake tensors and break down its peak."""
    check_units(units)
    options, training_config = with_config({**locals(), **shared}, ctx)
    recipe = recipe_from_options(options)
    check_report_paths(html, plot)
    layout = layout_from_options(options)
    expected = len(curve_sizes(recipe.batch_size)) if html else 1
    with trace_progress(progress_wanted(json_output, quiet), expected=expected) as progress:
        session = session_from_options(options, progress=progress)
        result = session.estimate(recipe, layout=layout)
        result = result.with_changes(notes=(*config_lines(training_config, options), *result.notes))
        points = session.batch_curve_points(result, layout)
        curve = batch_curve_for(result, points) if html else None
    write_reports(result, html=html, plot=plot, units=units, batch_curve=curve)
    return emit(result, json_output=json_output, units=units)
