"""Fresh-process ``vramplan measure`` rows for the tasks beyond classification and plain
training: detection, segmentation, video, diffusion, fine-tuning and inference, on a lent
card, written as ``<out>/<name>.json`` beside ``summary.json``::

    python -m benchmarks.gpu_harvest.task_rows --out /tmp/tasks --jobs 4 --budget-s 400

    >>> [row.name for row in TASK_ROWS][:2]
    ['frcnn-r50-b2-busy93', 'frcnn-r50-b2-min']

Detection rows train as torchvision's reference scripts (SGD with momentum, fp32, images
resized to 800/1333); ``measure`` builds each model with random weights, so the real run's
data-dependent counts (NMS, the samplers) fall between ``--detection-counts min`` and the
default ``max``, and the pair brackets it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.gpu_harvest.device_rows import measure_rows, row_of

BUSY = "-o momentum --busiest-image-boxes 93"
DETECTION = f"-b 2 {BUSY}"
SEG = "-o momentum --input-shape"
TV, SD15, T5 = "torchvision:", "diffusers:sd15-unet", "hf:google/flan-t5-base"
QWEN, SMOL = "hf:Qwen/Qwen2.5-0.5B", "hf:HuggingFaceTB/SmolLM2-360M"
MISTRAL = "hf:mistralai/Mistral-7B-v0.1"
TINYLLAMA, CKPT = "hf:TinyLlama/TinyLlama-1.1B-Chat-v1.0", "--checkpointing full"
TASK_ROWS = (
    row_of(
        "frcnn-r50-b2-busy93", f"{TV}fasterrcnn_resnet50_fpn", f"{DETECTION} --targets-on-gpu masks"
    ),
    row_of(
        "frcnn-r50-b2-min",
        f"{TV}fasterrcnn_resnet50_fpn",
        "-b 2 -o momentum --detection-counts min",
    ),
    row_of("maskrcnn-r50-b2-busy93", f"{TV}maskrcnn_resnet50_fpn", DETECTION),
    row_of("retinanet-r50-b2-busy93", f"{TV}retinanet_resnet50_fpn", DETECTION),
    row_of("keypointrcnn-r50-b2", f"{TV}keypointrcnn_resnet50_fpn", "-b 2 -o momentum"),
    row_of("fcos-r50-b2-busy93", f"{TV}fcos_resnet50_fpn", DETECTION),
    row_of("ssdlite-b24-busy93", f"{TV}ssdlite320_mobilenet_v3_large", f"-b 24 {BUSY}"),
    row_of("frcnn-mnv3-320-b2-busy93", f"{TV}fasterrcnn_mobilenet_v3_large_320_fpn", DETECTION),
    row_of("deeplabv3-r50-b4-512", f"{TV}deeplabv3_resnet50", f"-b 4 {SEG} 3x512x512"),
    row_of("fcn-r50-b2-512x1024", f"{TV}fcn_resnet50", f"-b 2 {SEG} 3x512x1024"),
    row_of("r3d18-b8-f16", f"{TV}r3d_18", "-b 8 --frames 16 -o sgd"),
    row_of("sd15-unet-b4-ampfp16", SD15, "-b 4 -p amp-fp16 -o adamw"),
    row_of("dit-xl-b16-ampbf16", "diffusers:dit-xl-2-256", "-b 16 -p amp-bf16 -o adamw"),
    row_of("flan-t5-base-fp16-b8-s256", T5, "-b 8 -s 256 -p fp16 -o adamw"),
    row_of("qwen05-lora16-bf16-b8-s1024", QWEN, "-b 8 -s 1024 -p bf16 --lora 16"),
    row_of("qwen05-bf16-chunks8-b8-s1024", QWEN, f"-b 8 -s 1024 -p bf16 --loss-chunks 8 {CKPT}"),
    row_of("tinyllama-infer-bf16-b8-s2048", TINYLLAMA, "-b 8 -s 2048 -p bf16 --mode infer"),
    row_of(
        "sd15-unet-b2-frozen-ampfp16", SD15, "-b 2 -p amp-fp16 -o adamw --diffusion-encoders frozen"
    ),
    row_of("flan-t5-base-bf16-b8-s512", T5, "-b 8 -s 512 -p bf16 -o adamw"),
    row_of("qwen05-dora16-bf16-b4-s1024", QWEN, "-b 4 -s 1024 -p bf16 --lora 16 --dora"),
    row_of("qwen05-oib-bf16-b8-s1024", QWEN, "-b 8 -s 1024 -p bf16 --optimizer-in-backward"),
    row_of("qwen05-offload-bf16-b8-s1024", QWEN, "-b 8 -s 1024 -p bf16 --activation-offload"),
    row_of(
        "qwen05-offload-ckpt-bf16-b8-s1024",
        QWEN,
        f"-b 8 -s 1024 -p bf16 --activation-offload {CKPT}",
    ),
    row_of("qwen05-fp32-b1-s256", QWEN, "-b 1 -s 256 -o adamw"),
    row_of("qwen05-oib-fp32-b1-s256", QWEN, "-b 1 -s 256 -o adamw --optimizer-in-backward"),
    row_of("smollm2-360m-packing-bf16-b8-s2048", SMOL, "-b 8 -s 2048 -p bf16 --packing"),
    row_of(
        "tinyllama-lora-ckpt-bf16-b8-s2048", TINYLLAMA, f"-b 8 -s 2048 -p bf16 --lora 16 {CKPT}"
    ),
    row_of("gpt2-compile-ampbf16-b8-s1024", "hf:gpt2", "-b 8 -s 1024 -p amp-bf16 --compile"),
    row_of("vit-b16-ampbf16-b64", f"{TV}vit_b_16", "-b 64 -p amp-bf16 -o adamw"),
    row_of("maskrcnn-infer-b8", f"{TV}maskrcnn_resnet50_fpn", "-b 8 --mode infer"),
    row_of("sd15-unet-ckpt-b8-ampfp16", SD15, f"-b 8 -p amp-fp16 -o adamw {CKPT}"),
    row_of("mistral7b-lora-ckpt-bf16-b2-s2048", MISTRAL, f"-b 2 -s 2048 -p bf16 --lora 16 {CKPT}"),
    row_of("llama32-1b-bf16-b4-s2048", "hf:meta-llama/Llama-3.2-1B", "-b 4 -s 2048 -p bf16"),
    row_of(
        "gemma2-2b-lora-bf16-b4-s1024", "hf:google/gemma-2-2b", "-b 4 -s 1024 -p bf16 --lora 16"
    ),
    row_of(
        "qwen15-moe-bf16-infer-b1-s1024",
        "hf:Qwen/Qwen1.5-MoE-A2.7B",
        "-s 1024 -p bf16 --mode infer",
    ),
    row_of("deberta-v3-base-fp32-b16-s512", "hf:microsoft/deberta-v3-base", "-b 16 -s 512"),
    row_of(
        "opt350m-fp16-infer-b4-s2048", "hf:facebook/opt-350m", "-b 4 -s 2048 -p fp16 --mode infer"
    ),
    row_of(
        "phi2-lora-ckpt-bf16-b4-s2048",
        "hf:microsoft/phi-2",
        f"-b 4 -s 2048 -p bf16 --lora 16 {CKPT}",
    ),
    row_of("qwen3-06b-bf16-b8-s1024", "hf:Qwen/Qwen3-0.6B", "-b 8 -s 1024 -p bf16"),
    row_of("dinov2-base-ampbf16-b32", "hf:facebook/dinov2-base", "-b 32 -p amp-bf16"),
    row_of("convnext-tiny-ampbf16-b64", "timm:convnext_tiny", "-b 64 -p amp-bf16"),
    row_of("swin-tiny-ampbf16-b64", "timm:swin_tiny_patch4_window7_224", "-b 64 -p amp-bf16"),
    row_of("efficientnet-b0-fp32-b64", "timm:efficientnet_b0", "-b 64"),
    row_of(
        "roberta-base-ampfp16-b32-s256", "hf:FacebookAI/roberta-base", "-b 32 -s 256 -p amp-fp16"
    ),
    row_of("bloom560m-ampfp16-b8-s512", "hf:bigscience/bloom-560m", "-b 8 -s 512 -p amp-fp16"),
)
"""Run on the H200 on 2026-11-27 (issues 15 and 17) in four batches: up to
``sd15-unet-b2-frozen-ampfp16``; up to ``sd15-unet-ckpt-b8-ampfp16`` (less the offload and
optimizer-in-backward rows); those two again once ``measure`` ran the tricks for real, with
their fp32 pair and offload with checkpointing; the models from ``mistral7b-...`` on.
diffusers rides along in ``carry`` where the card's image lacks it."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--budget-s", type=float, default=400)
    parser.add_argument("--only", help="comma-separated row names (default: all)")
    parser.add_argument("--start", help="the first row to run (default: the first)")
    options = parser.parse_args(argv)
    wanted = set(options.only.split(",")) if options.only else None
    names = [row.name for row in TASK_ROWS]
    first = names.index(options.start) if options.start else 0
    rows = tuple(row for row in TASK_ROWS[first:] if wanted is None or row.name in wanted)
    summary = measure_rows(options.out, options.jobs, options.budget_s, rows)
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for line in summary:
        print(json.dumps(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
