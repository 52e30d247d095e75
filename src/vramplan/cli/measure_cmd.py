"""``vramplan measure``: run the step for real and put it beside the estimate.

$ vramplan measure torchvision:resnet18 --batch-size 8
$ vramplan measure hf:HuggingFaceTB/SmolLM2-135M --seq-len 64 --lora 8 --device cpu
"""

from __future__ import annotations

from typing import Annotated

import typer

from vramplan.cli.app import app
from vramplan.cli.options import (
    FINETUNING,
    AllocConfOpt,
    BackboneNormOpt,
    BatchSize,
    BoxesPerImageOpt,
    BusiestImageBoxesOpt,
    CheckpointingOpt,
    DetectionCountsOpt,
    DiffusionEncodersOpt,
    FocalLossOpt,
    FramesOpt,
    GradAccum,
    HtmlOpt,
    InputShape,
    JsonOpt,
    Model,
    ModeOpt,
    OptimizerImplOpt,
    OptimizerOpt,
    PlotOpt,
    PrecisionOpt,
    ResolutionOpt,
    SeqLen,
    TargetsOnGpuOpt,
    TimeoutOpt,
    TrustRemoteCodeOpt,
    UnitsOpt,
    recipe_from_options,
    session_from_options,
    with_options,
)
from vramplan.report.measure import comparison_rows, render_comparison
from vramplan.report.outputs import check_report_paths, write_reports
from vramplan.report.render import check_units, print_json

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
@with_options(*FINETUNING)
def measure_command(
    model: Model,
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
    steps: StepsOpt = 3,
    device: DeviceOpt = None,
    snapshot: SnapshotOpt = None,
    alloc_conf: AllocConfOpt = None,
    html: HtmlOpt = None,
    plot: PlotOpt = None,
    timeout: TimeoutOpt = 300.0,
    trust_remote_code: TrustRemoteCodeOpt = False,
    json_output: JsonOpt = False,
    units: UnitsOpt = "binary",
    **shared,
) -> int:
    """Run N real steps, measure memory, and print estimate vs measurement and a leak check
    (LoRA, frozen parameters and the recipe tricks run for real too)."""
    check_units(units)
    recipe = recipe_from_options({**locals(), **shared})
    check_report_paths(html, plot)
    session = session_from_options(locals())
    result = session.measure(recipe, device=device, steps=steps, snapshot=snapshot)
    if html or plot:
        write_reports(
            result.estimate,
            html=html,
            plot=plot,
            units=units,
            measurement=comparison_rows(result, units),
        )
    if json_output:
        print_json(result.to_json())
    else:
        render_comparison(result, units)
    return 0
