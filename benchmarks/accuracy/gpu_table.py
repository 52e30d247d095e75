"""Re-estimate a committed GPU table on the CPU: every measured row of a harvest folder
(``benchmarks/results/gpu-*``) estimated again for the card and stack it was measured on,
beside what the GPU measured, with the device range's coverage::

    python -m benchmarks.accuracy.gpu_table benchmarks/results/gpu-nvidia-h200-2026-11-27
    python -m benchmarks.accuracy.gpu_table DIR --only vgg16     # rows whose name has this

Rows: the accuracy study's CSV (``accuracy/*.csv``: the H200's ran every workload in one
process, later harvests' a fresh process each), the fresh-process ``vramplan measure --json``
outputs (``rows/*.json``), and CNN runs under ``cudnn.benchmark = True``
(``rows/cudnn_benchmark_on.jsonl``). The estimate runs
with ``--gpu`` the measured card, ``--stack`` its torch and CUDA (so the harvest's measured
table applies) and ``--used-counter nvml-v2``: ``measure`` read NVML's per-process memory,
which holds no driver reserve. Issue 13's bar for a committed table: median absolute error
at most 3% allocated, 5% reserved, 5% device total, no row under by more than 5% on the
device.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import vramplan
from benchmarks.accuracy.run import recipe_of
from vramplan.device.catalog import lookup_gpu
from vramplan.errors import UserError
from vramplan.recipe import Recipe

FIGURES = ("allocated", "reserved", "device_total")
RANGES = {"reserved": "reserved_range_bytes", "device_total": "device_total_range_bytes"}


@dataclass(frozen=True)
class MeasuredRow:
    """One measured workload of a table: its model, recipe and the GPU's figures."""

    name: str
    model: str
    recipe: Recipe
    measured: dict[str, int]
    source: str
    cudnn_benchmark: bool = False


def study_rows(path: Path) -> list[MeasuredRow]:
    """The ok rows of an accuracy-study CSV."""
    with path.open() as handle:
        rows = [r for r in csv.DictReader(handle) if r["status"] == "ok"]
    return [
        MeasuredRow(
            r["name"],
            r["model"],
            recipe_of(r),
            {f: int(r[f"measured_{f}"]) for f in FIGURES if r.get(f"measured_{f}")},
            "study",
        )
        for r in rows
    ]


def measure_rows(folder: Path) -> list[MeasuredRow]:
    """``vramplan measure --json`` outputs: the recipe is the estimate's own."""
    rows = []
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        recipe = dict(data["estimate"]["recipe"])
        shape = recipe.pop("input_shape")
        recipe = Recipe(**recipe, input_shape=tuple(shape) if shape else None)
        measured = data["measured"]
        figures = {f: measured.get(f"{f}_bytes") for f in FIGURES}
        rows.append(
            MeasuredRow(
                path.stem,
                data["estimate"]["model"]["name"],
                recipe,
                {f: int(v) for f, v in figures.items() if v},
                "fresh process",
            )
        )
    return rows


def benchmark_rows(path: Path) -> list[MeasuredRow]:
    """The ``cudnn.benchmark = True`` runs (``rows/cudnn_benchmark_on.jsonl``: torchvision
    CNNs at 224x224, fp32, Adam, named ``<model>-b<batch>-bench``). Their device total is
    read after the search emptied the cache, not at the peak, so it is left out."""
    rows = []
    for line in path.read_text().splitlines() if path.exists() else ():
        data = json.loads(line)
        model, _, batch = data["name"].removesuffix("-bench").rpartition("-b")
        recipe = Recipe(batch_size=int(batch), input_shape=(3, 224, 224), optimizer="adam")
        measured = {f: int(data[f]) for f in ("allocated", "reserved")}
        rows.append(
            MeasuredRow(
                data["name"], f"torchvision:{model}", recipe, measured, "benchmark on", True
            )
        )
    return rows


def estimate_row(row: MeasuredRow, gpu: str, stack: str) -> dict:
    """The row's errors and whether each measured figure lies in the estimate's range."""
    session = vramplan.Session(
        row.model,
        gpu=gpu,
        stack=stack,
        used_counter="nvml-v2",
        cudnn_benchmark=row.cudnn_benchmark,
    )
    peak = session.estimate(row.recipe).peak
    estimate = {
        "allocated": peak.allocated_bytes,
        "reserved": peak.reserved_bytes,
        "device_total": peak.device_total_bytes,
    }
    out = {"name": row.name, "source": row.source}
    for figure, measured in row.measured.items():
        out[f"error_{figure}"] = (estimate[figure] - measured) / measured
        out[f"estimate_{figure}"] = estimate[figure]
        out[f"measured_{figure}"] = measured
        if figure in RANGES:
            low, high = getattr(peak, RANGES[figure])
            out[f"inside_{figure}"] = low <= measured <= high
            out[f"high_over_{figure}"] = high / estimate[figure] - 1
    return out


def table_identity(folder: Path) -> tuple[str, str]:
    """(catalog card name, ``torchX.Y-cuA.B``) of a harvest folder."""
    harvest = json.loads((folder / "harvest.json").read_text())
    card = lookup_gpu(harvest["device"]["name"].replace("NVIDIA ", "")).name
    torch_version = ".".join(harvest["stack"]["torch"].split("+")[0].split(".")[:2])
    return card, f"torch{torch_version}-cu{harvest['stack']['cuda']}"


def summary(results: list[dict]) -> list[str]:
    """Median and worst error per figure, and the range's coverage."""
    lines = [
        "| figure | rows | median abs error | worst under | worst over | inside range |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for figure in FIGURES:
        errors = [r[f"error_{figure}"] for r in results if f"error_{figure}" in r]
        if not errors:
            continue
        inside = [r[f"inside_{figure}"] for r in results if f"inside_{figure}" in r]
        coverage = f"{sum(inside)}/{len(inside)}" if inside else "-"
        lines.append(
            f"| {figure} | {len(errors)} | {statistics.median(abs(e) for e in errors):.1%} | "
            f"{min(0.0, min(errors)):+.1%} | {max(0.0, max(errors)):+.1%} | {coverage} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a benchmarks/results/gpu-* folder")
    parser.add_argument("--only", help="only rows whose name contains this")
    options = parser.parse_args()
    gpu, stack = table_identity(options.folder)
    rows = [
        row for path in sorted(options.folder.glob("accuracy/*.csv")) for row in study_rows(path)
    ]
    rows += measure_rows(options.folder / "rows")
    rows += benchmark_rows(options.folder / "rows" / "cudnn_benchmark_on.jsonl")
    if options.only:
        rows = [row for row in rows if options.only in row.name]
    print(f"{options.folder.name}: {gpu}, stack {stack}, {len(rows)} rows\n")
    print("| row | source | allocated | reserved | device total | device measured in range |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    results = []
    for row in rows:
        try:
            result = estimate_row(row, gpu, stack)
        except UserError as exc:
            print(f"| {row.name} | {row.source} | error: {exc} | | | |")
            continue
        results.append(result)
        cells = [f"{result[f'error_{f}']:+.1%}" if f"error_{f}" in result else "-" for f in FIGURES]
        inside = result.get("inside_device_total")
        print(f"| {row.name} | {row.source} | {' | '.join(cells)} | {inside} |", flush=True)
    for source in sorted({r["source"] for r in results}):
        print(f"\n{source}:\n")
        print("\n".join(summary([r for r in results if r["source"] == source])))
    print("\nall rows:\n")
    print("\n".join(summary(results)))


if __name__ == "__main__":
    main()
