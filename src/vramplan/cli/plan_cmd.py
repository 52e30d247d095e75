"""``vramplan plan`` and ``vramplan max-batch``: what fits, and what to change when it does not.

$ vramplan max-batch torchvision:resnet50 --gpu t4
$ vramplan plan hf:meta-llama-3-8b --seq-len 4096 --batch-size 8 --gpu a100-80gb
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
    TargetsOnGpuOpt,
    TfMemoryGrowthOpt,
    TfMemoryLimitOpt,
    TimeoutOpt,
    TrustRemoteCodeOpt,
    UnitsOpt,
    UsedCounterOpt,
    layout_from_options,
    recipe_from_options,
    session_from_options,
    with_options,
)
from vramplan.report.config import render_config_lines
from vramplan.report.outputs import batch_curve_for, check_report_paths, write_reports
from vramplan.report.plan import plan_rows, render_max_batch, render_plan
from vramplan.report.progress import progress_wanted, trace_progress
from vramplan.report.render import check_units, print_json

SearchOpt = Annotated[
    str,
    typer.Option(
        "--search", help="batch-size | seq-len | prompt-len | new-tokens (the last two: generate)"
    ),
]
HostMemoryOpt = Annotated[
    str | None,
    typer.Option("--host-memory", help="System RAM to check the run against, e.g. 64GiB."),
]
WorkersOpt = Annotated[int, typer.Option("--workers", help="DataLoader worker processes.")]
JobsOpt = Annotated[
    int | None,
    typer.Option(
        "--jobs",
        "-j",
        help="Processes that trace at once (default: the idle cores, at most 8; 1: one "
        "trace at a time). The answer is the same; only the wall-clock changes.",
    ),
]


@app.command("max-batch")
@with_options(*FINETUNING, LAYOUT)
def max_batch_command(
    ctx: typer.Context,
    model: OptionalModel = None,
    config: ConfigOpt = None,
    gpu: GpuOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    search: SearchOpt = "batch-size",
    batch_size: BatchSize = 1,
    seq_len: SeqLen = None,
    input_shape: InputShape = None,
    precision: PrecisionOpt = "fp32",
    optimizer: OptimizerOpt = "adamw",
    optimizer_impl: OptimizerImplOpt = "auto",
    checkpointing: CheckpointingOpt = "none",
    grad_accum: GradAccum = 1,
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
    headroom: HeadroomOpt = 0.10,
    alloc_conf: AllocConfOpt = None,
    cudnn_benchmark: CudnnBenchmarkOpt = False,
    profile: ProfileOpt = None,
    stack: StackOpt = None,
    used_counter: UsedCounterOpt = "nvml-v1",
    jobs: JobsOpt = None,
    timeout: TimeoutOpt = 300.0,
    trust_remote_code: TrustRemoteCodeOpt = False,
    allow_custom_objects: AllowCustomObjectsOpt = False,
    framework: FrameworkOpt = "pytorch",
    tf_memory_growth: TfMemoryGrowthOpt = False,
    tf_memory_limit: TfMemoryLimitOpt = None,
    json_output: JsonOpt = False,
    units: UnitsOpt = "binary",
    quiet: QuietOpt = False,
    **shared,
) -> int:
    """The largest batch (or --search seq-len: the longest context) that fits the card;
    with a parallel layout (--fsdp N, --zero N...), the per-GPU batch whose rank fits."""
    check_units(units)
    options, training_config = with_config({**locals(), **shared}, ctx)
    recipe = recipe_from_options(options)
    layout = layout_from_options(options)
    with trace_progress(progress_wanted(json_output, quiet)) as progress:
        session = session_from_options(options, progress=progress)
        result = session.max_batch(recipe, search=search, layout=layout)
    lines = config_lines(training_config, options)
    if json_output:
        print_json({**result.to_json(), **({"config": list(lines)} if lines else {})})
    else:
        render_config_lines(lines)
        render_max_batch(result, units)
    return 0


@app.command("plan")
@with_options(*FINETUNING, LAYOUT)
def plan_command(
    ctx: typer.Context,
    model: OptionalModel = None,
    config: ConfigOpt = None,
    gpu: GpuOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    batch_size: BatchSize = 1,
    seq_len: SeqLen = None,
    input_shape: InputShape = None,
    precision: PrecisionOpt = "fp32",
    optimizer: OptimizerOpt = "adamw",
    optimizer_impl: OptimizerImplOpt = "auto",
    checkpointing: CheckpointingOpt = "none",
    grad_accum: GradAccum = 1,
    mode: ModeOpt = "train",
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
    headroom: HeadroomOpt = 0.10,
    alloc_conf: AllocConfOpt = None,
    cudnn_benchmark: CudnnBenchmarkOpt = False,
    profile: ProfileOpt = None,
    stack: StackOpt = None,
    used_counter: UsedCounterOpt = "nvml-v1",
    host_memory_limit: HostMemoryOpt = None,
    workers: WorkersOpt = 4,
    html: HtmlOpt = None,
    plot: PlotOpt = None,
    jobs: JobsOpt = None,
    timeout: TimeoutOpt = 300.0,
    trust_remote_code: TrustRemoteCodeOpt = False,
    allow_custom_objects: AllowCustomObjectsOpt = False,
    framework: FrameworkOpt = "pytorch",
    tf_memory_growth: TfMemoryGrowthOpt = False,
    tf_memory_limit: TfMemoryLimitOpt = None,
    json_output: JsonOpt = False,
    units: UnitsOpt = "binary",
    quiet: QuietOpt = False,
    **shared,
) -> int:
    """Rank the levers that cut memory and give the first plan that fits; without --gpu,
    judge every catalog GPU. With a parallel layout (--fsdp N, --zero N...), from one
    rank of it."""
    check_units(units)
    options, training_config = with_config({**locals(), **shared}, ctx)
    recipe = recipe_from_options(options)
    # without --zero, --offload-optimizer counts the optimizer state in host RAM only
    host_offload = options["offload_optimizer"]
    zero_offload = host_offload and options["zero"] is not None
    layout = layout_from_options({**options, "offload_optimizer": zero_offload})
    check_report_paths(html, plot)
    with trace_progress(progress_wanted(json_output, quiet)) as progress:
        session = session_from_options(options, progress=progress)
        answer = session.plan(
            recipe,
            host_memory=host_memory_limit,
            workers=workers,
            offload_optimizer=host_offload,
            layout=layout,
        )
        baseline = answer.levers.baseline
        points = session.batch_curve_points(baseline, layout)
        curve = batch_curve_for(baseline, points) if html else None
    if html or plot:
        write_reports(
            baseline,
            html=html,
            plot=plot,
            units=units,
            batch_curve=curve,
            plan=plan_rows(answer, units),
        )
    lines = config_lines(training_config, options)
    if json_output:
        print_json({**answer.to_json(), **({"config": list(lines)} if lines else {})})
    else:
        render_config_lines(lines)
        render_plan(answer, units)
    return 0
