"""Estimate the published measurements vramplan can express and report the errors.

    python -m benchmarks.accuracy.published

``published.csv`` here maps rows of ../shared/validation/published.csv (by ``row_id``) to
vramplan recipes; every other row is listed with the reason it cannot be expressed yet.
Errors compare the same quantity the source measured: ``allocated`` against
``torch.cuda.max_memory_allocated``, ``device_total`` against NVML's used memory.
"""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

from vramplan.device.options import device_options
from vramplan.device.profile import DeviceProfile
from vramplan.errors import UserError
from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe, parse_shape
from vramplan.sources import resolve

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parents[2] / "shared" / "validation" / "published.csv"
MiB = 2**20
NOT_EXPRESSIBLE = {
    "mmdetection": "detection losses need data-dependent box matching (fake tensors cannot run it)",
    "detectron2": "detection model",
    "torchvision-detection": "detection model",
    "mmdetection-vs-detectron2": "detection model",
}


def _profile(row: dict, gpu: str) -> DeviceProfile | None:
    if not row["profile_context_mib"]:
        return None
    return DeviceProfile(
        gpu=gpu,
        total_bytes=0,
        driver="460.91.03",
        cuda="11.2",
        torch="?",
        cuda_context_bytes=int(row["profile_context_mib"]) * MiB,
        cublas_workspace_bytes=0,
    )


def estimate_row(row: dict) -> int:
    recipe = Recipe(
        batch_size=int(row["batch_size"]),
        seq_len=int(row["seq_len"]) if row["seq_len"] else None,
        input_shape=parse_shape(row["input_shape"]) if row["input_shape"] else None,
        precision=row["precision"],
        optimizer=row["optimizer"],
        checkpointing=row["checkpointing"],
        grad_accum=int(row["grad_accum"]),
    )
    options = device_options(gpu=row["gpu"])
    options = options.__class__(
        gpu=options.gpu, headroom=options.headroom, profile=_profile(row, options.gpu.name)
    )
    estimate = estimate_built(resolve(row["model"], recipe), recipe, "cuda", options)
    return {
        "allocated": estimate.peak.allocated_bytes,
        "device_total": estimate.peak.device_total_bytes,
    }[row["metric"]]


def main() -> None:
    published = {r["row_id"]: r for r in csv.DictReader(SOURCE.open())} if SOURCE.exists() else {}
    mapped = list(csv.DictReader((HERE / "published.csv").open()))
    print("| row | quality | model | metric | measured MiB | estimate MiB | error |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: |")
    by_quality: dict[str, list[float]] = {}
    for row in mapped:
        source = published.get(row["row_id"], {})
        measured = float(source.get("value_MiB", "nan"))
        try:
            estimate = estimate_row(row) / MiB
        except UserError as exc:
            print(f"| {row['row_id']} | | {row['model']} | | | | cannot run: {exc} |")
            continue
        error = (estimate - measured) / measured
        quality = source.get("quality", "?")
        by_quality.setdefault(quality, []).append(error)
        print(
            f"| {row['row_id']} | {quality} | {source.get('model', row['model'])[:40]} | "
            f"{row['metric']} | {measured:.0f} | {estimate:.0f} | {error:+.1%} |",
            flush=True,
        )
    print()
    print("| quality | rows | median abs error | worst under-prediction |")
    print("| --- | ---: | ---: | ---: |")
    for quality, errors in sorted(by_quality.items()):
        print(
            f"| {quality} | {len(errors)} | {statistics.median(abs(e) for e in errors):.1%} | "
            f"{min(min(errors), 0.0):+.1%} |"
        )
    expressed = {r["row_id"] for r in mapped}
    print("\nRows not expressed yet:")
    for row_id, source in published.items():
        if row_id in expressed:
            continue
        reason = NOT_EXPRESSIBLE.get(source["group"], _reason(source))
        print(f"- row {row_id} ({source['model'][:50]}): {reason}")


def _reason(source: dict) -> str:
    text = " ".join(source.values()).lower()
    if "float8" in text or "mode=compile" in text or "torch.compile" in text:
        return "float8 training or torch.compile: not traced"
    if "sac" in text.split() or "selective op" in text or "op-level sac" in text:
        return "op-level selective activation checkpointing (torchtitan SAC) is not a mode here"
    if "lora" in text or "4-bit" in text or "nf4" in text:
        return "LoRA/QLoRA tracing (frozen or quantised base) is formula-only (`vramplan llm`)"
    if "fsdp" in text or "deepspeed" in text or "zero" in text:
        return "sharded run whose model or setup is not bundled (FSDP2 is traced, ZeRO by formula)"
    if "generate" in text:
        return "generation loops (KV cache growing over decode steps) are not traced"
    if "context" in source.get("model", "").lower():
        return "a runtime floor, used as the calibration profile for rows 74-82"
    return "model or setting not bundled (no config here)"


if __name__ == "__main__":
    main()
