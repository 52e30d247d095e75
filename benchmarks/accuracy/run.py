"""Run the accuracy study: estimate each workload, run it for real, write a CSV and a
summary (median and 95th-percentile absolute relative error, worst under-prediction).

    python -m benchmarks.accuracy.run                 # every workload, on cuda if present
    python -m benchmarks.accuracy.run --quick         # the first 8
    python -m benchmarks.accuracy.run --device cpu --only gpt2
    python -m benchmarks.accuracy.run --device cuda --jobs 4   # four fresh processes at once

On the CPU it measures CPU execution against ``target="cpu"`` estimates (peak live tensor
bytes); on a GPU it measures CUDA (allocated, reserved, device total) against the default
CUDA-emulating estimates. On CUDA each workload runs in a fresh process, ``--jobs`` of them
at once: each process reads its own ``max_memory_*`` and NVML per-process figures, so
concurrent workloads do not see each other's memory while the card holds them all.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import multiprocessing
import platform
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import torch

import vramplan
from vramplan.errors import UserError
from vramplan.measurement.compare import FIGURES
from vramplan.measurement.run import default_device
from vramplan.recipe import Recipe, parse_shape

HERE = Path(__file__).resolve().parent
COLUMNS = [
    "name",
    "model",
    "batch_size",
    "input_shape",
    "seq_len",
    "precision",
    "optimizer",
    "checkpointing",
    "grad_accum",
    "mode",
    "device",
    "status",
]
for _figure in FIGURES:
    COLUMNS += [f"estimate_{_figure}", f"measured_{_figure}", f"error_{_figure}"]
RANGED = ("reserved", "device_total")
"""The device-level figures an estimate gives a [low, high] range for."""
for _figure in RANGED:
    COLUMNS += [f"low_{_figure}", f"high_{_figure}", f"inside_{_figure}"]
COLUMNS += ["estimate_seconds", "measure_seconds", "torch", "cuda", "driver", "gpu"]


def load_workloads(path: Path = HERE / "workloads.csv") -> list[dict]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


def recipe_of(row: dict) -> Recipe:
    return Recipe(
        batch_size=int(row["batch_size"]),
        seq_len=int(row["seq_len"]) if row["seq_len"] else None,
        input_shape=parse_shape(row["input_shape"]) if row["input_shape"] else None,
        precision=row["precision"],
        optimizer=row["optimizer"],
        checkpointing=row["checkpointing"],
        grad_accum=int(row["grad_accum"]),
        mode=row["mode"],
    )


def run_one(row: dict, device: str) -> dict:
    out = {key: row[key] for key in COLUMNS if key in row}
    out["device"] = device
    start = time.perf_counter()
    try:
        result = vramplan.Session(row["model"]).measure(recipe_of(row), device=device, steps=3)
    except UserError as exc:
        out["status"] = f"error: {exc}"
        return out
    except Exception as exc:  # a benchmark records a workload that breaks and goes on
        out["status"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        return out
    out["status"] = "oom" if result.measured.oom else "ok"
    peak = result.estimate.peak
    # the measured device total in the estimate's counter (NVML v1 holds the driver's
    # reserve, a per-process reading does not), so the range check compares like with like
    pairs = result.pairs()
    estimates = {figure: pair[0] for figure, pair in pairs.items()}
    measured = {figure: pair[1] for figure, pair in pairs.items()}
    for figure in FIGURES:
        if measured[figure]:
            out[f"estimate_{figure}"] = estimates[figure]
            out[f"measured_{figure}"] = measured[figure]
            out[f"error_{figure}"] = result.errors.get(figure)
    ranges = {"reserved": peak.reserved_range_bytes, "device_total": peak.device_total_range_bytes}
    for figure in RANGED:
        if measured[figure] and ranges[figure]:
            low, high = ranges[figure]
            out.update({f"low_{figure}": low, f"high_{figure}": high})
            out[f"inside_{figure}"] = "yes" if low <= measured[figure] <= high else "no"
    out["measure_seconds"] = round(time.perf_counter() - start, 2)
    versions = result.measured.versions
    out.update(
        {
            "torch": torch.__version__,
            "cuda": versions.get("cuda", ""),
            "driver": versions.get("driver", ""),
            "gpu": versions.get("gpu", platform.processor() or "cpu"),
        }
    )
    return out


def run_fresh(row: dict, device: str) -> dict:
    """``run_one`` in a new process, as a training job starts: on CUDA the device total
    then holds only the kernels this workload loads (one process for the whole study keeps
    every earlier workload's cuBLAS and cuDNN kernels loaded)."""
    context = multiprocessing.get_context("spawn")
    try:
        with ProcessPoolExecutor(1, mp_context=context) as pool:
            return pool.submit(run_one, row, device).result()
    except BrokenProcessPool as exc:
        return {**{k: row[k] for k in COLUMNS if k in row}, "status": f"failed: {exc}"}


def run_all(
    workloads: list[dict], device: str, fresh: bool, jobs: int = 1
) -> Iterator[tuple[int, dict]]:
    """(index, result) of every workload as each finishes: in this process one after the
    other, or each in a fresh process (``run_fresh``), ``jobs`` at a time."""
    if not fresh:
        for index, row in enumerate(workloads):
            yield index, run_one(row, device)
        return
    with ThreadPoolExecutor(max(1, jobs)) as threads:
        futures = {threads.submit(run_fresh, row, device): i for i, row in enumerate(workloads)}
        for future in as_completed(futures):
            yield futures[future], future.result()


def summarise(rows: list[dict]) -> list[str]:
    lines = [
        "| figure | workloads | median abs error | p95 abs error | worst under-prediction "
        "| inside [low, high] |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for figure in FIGURES:
        errors = [
            float(r[f"error_{figure}"]) for r in rows if r.get(f"error_{figure}") not in (None, "")
        ]
        if not errors:
            continue
        absolute = sorted(abs(e) for e in errors)
        p95 = absolute[min(len(absolute) - 1, round(0.95 * (len(absolute) - 1)))]
        worst = min(errors)
        inside = [r[f"inside_{figure}"] for r in rows if r.get(f"inside_{figure}")]
        coverage = f"{inside.count('yes')} of {len(inside)}" if inside else "-"
        lines.append(
            f"| {figure} | {len(errors)} | {statistics.median(absolute):.2%} | "
            f"{p95:.2%} | {min(worst, 0.0):+.2%} | {coverage} |"
        )
    return lines


def _label(rows: list[dict], device: str) -> str:
    return rows[0]["gpu"].replace(" ", "_") if device == "cuda" and rows[0].get("gpu") else "cpu"


def _write_csv(rows: list[dict], options: argparse.Namespace, stamp: str) -> Path:
    path = options.output / f"{options.device}-{_label(rows, options.device)}-{stamp}.csv"
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default=default_device())
    parser.add_argument("--quick", action="store_true", help="only the first 8 workloads")
    parser.add_argument("--only", help="only workloads whose name contains this")
    parser.add_argument("--output", type=Path, default=HERE / "results")
    parser.add_argument(
        "--same-process",
        action="store_true",
        help="run every workload in this process (on CUDA each gets a fresh one by default)",
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="fresh processes at once (CUDA; default 1)"
    )
    options = parser.parse_args()
    fresh = options.device == "cuda" and not options.same_process
    workloads = load_workloads()
    if options.only:
        workloads = [w for w in workloads if options.only in w["name"]]
    if options.quick:
        workloads = workloads[:8]
    stamp = datetime.date.today().isoformat()
    options.output.mkdir(parents=True, exist_ok=True)
    done: dict[int, dict] = {}
    path = None
    for index, result in run_all(workloads, options.device, fresh, options.jobs):
        done[index] = result
        error = result.get("error_allocated")
        print(
            f"{workloads[index]['name']:<28} {result['status']:<6} allocated error "
            f"{'' if error is None else f'{float(error):+.2%}'}",
            flush=True,
        )
        rows = [done[i] for i in sorted(done)]  # the workloads' order, whatever finished first
        path = _write_csv(rows, options, stamp)  # after every workload: a cut-off run keeps it
    if path is None:
        return
    summary = summarise([r for r in rows if r["status"] == "ok"])
    label = _label(rows, options.device)
    header = (
        f"Accuracy study on {options.device} ({label}), torch {torch.__version__}, "
        f"{stamp}: {sum(r['status'] == 'ok' for r in rows)} of {len(rows)} workloads ran."
    )
    path.with_suffix(".md").write_text("\n".join([header, "", *summary, ""]))
    print("\n".join([header, *summary]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
