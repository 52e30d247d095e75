"""Estimate the published measurements vramplan can express and report the errors.

    python -m benchmarks.accuracy.published            # every mapped row
    python -m benchmarks.accuracy.published 83 85 87   # only these rows

``published.csv`` here maps rows of ../shared/validation/published.csv (by ``row_id``) to
vramplan recipes; every other row is listed with the reason it cannot be expressed yet.
Errors compare the same quantity the source measured: ``allocated`` against
``torch.cuda.max_memory_allocated``, ``device_total`` against NVML's used memory (with the
row's ``used_counter``; a profile context is read with that counter, so the driver reserve
an nvml-v1 reading includes is taken out of it and counted once). Device-level rows also
report whether the measurement lies in vramplan's [low, high] range.

The ``stack`` column names the software stack a row was measured on (``--stack``), where
it changes the step: autograd before PyTorch 1.1 kept both operands of mul/div
(``trace/legacy_saving.py``), before 1.11 softmax's input (``trace/legacy_softmax.py``),
and optimizers before 2.0 looped per parameter. The 2022 BERT rows also name
``additive_mask`` (transformers 4.15 always added its attention mask to the scores).

A ``dp=N`` knob runs the row as one rank of N-GPU plain data parallelism (PyTorch's
DDP: the reducer's gradient buckets, ``distributed/layout.py``), as the model zoos train.
An ``fsdp=N`` knob traces one rank of N under PyTorch's FSDP2 (``distributed/fsdp.py``,
``--fsdp N``). ``fsdp_version=1`` is FSDP1 (``--fsdp-version 1``) and ``reentrant=1``
transformers 4.x's reentrant checkpointing (``--reentrant``): together they add what FSDP1
holds (``fsdp1_held_blocks``: a frozen block's input and its gradient until backward ends).

The COCO detection rows (torchvision's reference scripts, mmdetection, detectron2) give
``busiest_image_boxes=93`` (``--busiest-image-boxes``): their ``max_memory_allocated`` is
over a whole run, whose busiest image in COCO train2017 holds 93 annotated boxes
(fchollet/deep-learning-with-python-notebooks#299 counts them; Megvii-BaseDetection/YOLOX#499:
"more than 90"), and the anchor matching's IoU matrices grow with the boxes; the batch's
other images keep the default 20. The Keypoint R-CNN row keeps 20 throughout: no count of
COCO's person-keypoint annotations per image was found.

The GPUMemNet rows (48-51, 54, 55, 1000-1002) use row 1003, the same setup's measured
floor (a one-neuron MLP: context, cuBLAS kernels, driver reserve; no cuDNN), as their
profile, as the BERT rows use their measured context.
"""

from __future__ import annotations

import csv
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from vramplan.device.options import device_options
from vramplan.device.profile import DeviceProfile
from vramplan.device.runtime import driver_reserved_bytes
from vramplan.distributed.facts import facts_of
from vramplan.distributed.fsdp import engine_for
from vramplan.distributed.layout import ParallelLayout, per_rank
from vramplan.errors import UserError
from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe, parse_shape
from vramplan.sources import resolve

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parents[2] / "shared" / "validation" / "published.csv"
MiB = 2**20


def _profile(row: dict, gpu, counter: str) -> DeviceProfile | None:
    if not row["profile_context_mib"]:
        return None
    reserve = driver_reserved_bytes(gpu) if counter == "nvml-v1" else 0
    return DeviceProfile(
        gpu=gpu.name,
        total_bytes=0,
        driver="460.91.03",
        cuda="11.2",
        torch="?",
        cuda_context_bytes=int(row["profile_context_mib"]) * MiB - reserve,
        cublas_workspace_bytes=0,
        cudnn_loaded=row.get("profile_has_cudnn", "") != "no",
        cublas_loaded=row.get("profile_has_cublas", "") != "no",
    )


def knobs(text: str) -> dict:
    """The ``knobs`` column: ``name=value`` pairs separated by spaces (fine-tuning and recipe
    tricks; ``;`` stands for ``,`` inside a value).

    >>> knobs("lora_rank=8 lora_targets=q_proj;v_proj double_quant=1 lora_dropout=0.1")
    {'lora_rank': 8, 'lora_targets': 'q_proj,v_proj', 'double_quant': True, 'lora_dropout': 0.1}
    """
    flags = (
        "double_quant",
        "packing",
        "optimizer_in_backward",
        "activation_offload",
        "fused_ce",
        "loss_shift_copy",
        "loss_no_upcast",
        "additive_mask",
        "compile",
        "anchor_cache",
        "reentrant",
    )
    found: dict = {}
    for pair in text.split():
        name, _, value = pair.partition("=")
        if name in flags:
            found[name] = value == "1"
        elif value.replace(".", "", 1).isdigit():
            found[name] = float(value) if "." in value else int(value)
        else:
            found[name] = value.replace(";", ",")
    return found


def estimate_row(row: dict) -> tuple[int, tuple[int, int] | None]:
    """The estimate of the row's metric, and its [low, high] range (device-level rows)."""
    extra = knobs(row.get("knobs") or "")
    fsdp = extra.pop("fsdp", 0)
    version = extra.pop("fsdp_version", 2)
    layout = (
        ParallelLayout(shard="fsdp", data_parallel=fsdp, fsdp_version=version)
        if fsdp
        else ParallelLayout(data_parallel=extra.pop("dp", 1))
    )
    recipe = Recipe(
        batch_size=int(row["batch_size"]),
        seq_len=int(row["seq_len"]) if row["seq_len"] else None,
        input_shape=parse_shape(row["input_shape"]) if row["input_shape"] else None,
        precision=row["precision"],
        optimizer=row["optimizer"],
        checkpointing=row["checkpointing"],
        grad_accum=int(row["grad_accum"]),
        optimizer_impl=row.get("optimizer_impl") or "auto",
        attention=row.get("attention") or None,
        **extra,
    )
    counter = row.get("used_counter") or "nvml-v1"
    options = device_options(gpu=row["gpu"], used_counter=counter, stack=row.get("stack") or None)
    options = replace(options, profile=_profile(row, options.gpu, counter))
    built = resolve(row["model"], recipe)
    engine = engine_for(layout)
    estimate = estimate_built(built, recipe, "cuda", options, engine=engine)
    if engine is None and layout != ParallelLayout():
        estimate = per_rank(estimate, layout, facts_of(built))
    if row["metric"] == "allocated":
        return estimate.peak.allocated_bytes, None
    if row["metric"] == "reserved":
        return estimate.peak.reserved_bytes, None
    return estimate.peak.device_total_bytes, estimate.peak.device_total_range_bytes


def main(only: list[str] | None = None) -> None:
    published = {r["row_id"]: r for r in csv.DictReader(SOURCE.open())} if SOURCE.exists() else {}
    mapped = list(csv.DictReader((HERE / "published.csv").open()))
    if only:
        mapped = [r for r in mapped if r["row_id"] in only]
    print(
        "| row | quality | model | metric | measured MiB | estimate MiB | error | "
        "range MiB | in range |"
    )
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- |")
    by_quality: dict[str, list[float]] = {}
    # per source group: error, covered, (high - central) / central
    device: dict[str, list[tuple[float, bool, float]]] = {}
    for row in mapped:
        source = published.get(row["row_id"], {})
        measured = float(source.get("value_MiB", "nan"))
        try:
            central, span = estimate_row(row)
            estimate = central / MiB
        except UserError as exc:
            print(f"| {row['row_id']} | | {row['model']} | | | | cannot run: {exc} |")
            continue
        error = (estimate - measured) / measured
        quality = source.get("quality", "?")
        by_quality.setdefault(quality, []).append(error)
        shown, covered = "", ""
        if span is not None:
            low, high = span[0] / MiB, span[1] / MiB
            inside = low <= measured <= high
            device.setdefault(source.get("group", "?"), []).append(
                (error, inside, (high - estimate) / estimate)
            )
            shown, covered = f"{low:.0f}-{high:.0f}", "yes" if inside else "no"
        print(
            f"| {row['row_id']} | {quality} | {source.get('model', row['model'])[:40]} | "
            f"{row['metric']} | {measured:.0f} | {estimate:.0f} | {error:+.1%} | "
            f"{shown} | {covered} |",
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
    for group, rows in sorted(device.items()):
        errors = [e for e, _, _ in rows]
        print(
            f"\nDevice-level rows, {group} ({len(rows)}): median |error| "
            f"{statistics.median(abs(e) for e in errors):.1%}, worst under-prediction "
            f"{min(min(errors), 0.0):+.1%}, measured inside [low, high] "
            f"{sum(c for _, c, _ in rows)}/{len(rows)}, median (high - central)/central "
            f"{statistics.median(w for _, _, w in rows):.1%}"
        )
    if only:
        return
    expressed = {r["row_id"] for r in mapped}
    print("\nRows not expressed yet:")
    for row_id, source in published.items():
        if row_id in expressed:
            continue
        reason = _reason(source)
        print(f"- row {row_id} ({source['model'][:50]}): {reason}")


def _reason(source: dict) -> str:
    text = " ".join(source.values()).lower()
    if "float8" in text or "mode=compile" in text or "torch.compile" in text:
        return "float8 training or torch.compile: not traced"
    if "sac" in text.split() or "selective op" in text or "op-level sac" in text:
        return "op-level selective activation checkpointing (torchtitan SAC) is not a mode here"
    if "zero-3" in text and "lora" in text:
        return "LoRA under DeepSpeed ZeRO-3 with CPU offload: ZeRO is formula-only"
    if "fsdp" in text or "deepspeed" in text or "zero" in text:
        return "sharded run whose model or setup is not bundled (FSDP2 is traced, ZeRO by formula)"
    if "generate" in text:
        return "generation loops (KV cache growing over decode steps) are not traced"
    if source.get("rebuild_fidelity") == "floor only":
        return "the GPUMemNet floor, used as the profile of rows 48-51, 54, 55, 1000-1002"
    if "context" in source.get("model", "").lower():
        return "a runtime floor, used as the calibration profile for rows 74-82"
    return "model or setting not bundled (no config here)"


if __name__ == "__main__":
    main(sys.argv[1:])
