"""Harvest one CUDA GPU: process floor, NVML counters, cuBLAS and cuDNN workspaces, a
calibration profile, fresh-process ``vramplan measure`` rows of published setups
(``device_rows.py``) and the accuracy study, in about ten minutes::

    python -m benchmarks.gpu_harvest                      # everything
    python -m benchmarks.gpu_harvest --quick --skip-study # a few minutes

Writes ``benchmarks/results/gpu-<gpu>-<date>/harvest.json`` and ``harvest.md`` (rewritten
after every section, so an interrupted run keeps what it had), and the device model's data
file ``src/vramplan/data/measured/<gpu>-<stack>.json``. Without a GPU it says so on stderr
and exits 2. The parent process never starts CUDA: every measurement runs in a child.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import warnings
from pathlib import Path

from benchmarks.gpu_harvest.child import ROOT

RESULTS = ROOT / "benchmarks" / "results"
MEASURED = ROOT / "src" / "vramplan" / "data" / "measured"
BUDGET_S = 570.0
TWO_ROWS_AT_ONCE = 70 * 2**30
"""Cards this large run two fresh measure rows at once: the largest (VGG-16 at batch 128,
TinyLlama in fp32 with AdamW) take about 25 GB each, and a cuDNN engine that fails to
allocate falls to the next, which would change what a row measures."""


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_harvest", description=__doc__)
    parser.add_argument("--out", type=Path, help="folder (default benchmarks/results/gpu-...)")
    parser.add_argument("--quick", action="store_true", help="fewer conv cases, quick study")
    parser.add_argument("--skip-study", action="store_true", help="do not run the study")
    parser.add_argument("--measured-dir", type=Path, default=MEASURED)
    parser.add_argument("--conv-budget-s", type=float, help="seconds per benchmark setting")
    parser.add_argument(
        "--budget-s", type=float, default=BUDGET_S, help="the study ends by then (seconds)"
    )
    parser.add_argument(
        "--jobs", type=int, default=4, help="the study's fresh processes at once (default 4)"
    )
    parser.add_argument("--skip-rows", action="store_true", help="no fresh measure rows")
    parser.add_argument(
        "--task-convs-only",
        action="store_true",
        help="convolutions: only the task rows' (task_convs.json), merged into the card's "
        "bundled table where there is one",
    )
    return parser.parse_args(argv)


def _has_gpu() -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a CUDA build without a driver warns here
        import torch

        return torch.cuda.is_available() and torch.cuda.device_count() > 0


class Harvest:
    """The harvest dict and where it is written."""

    def __init__(self, options: argparse.Namespace) -> None:
        self.options = options
        self.start = time.monotonic()
        self.folder: Path | None = options.out
        self.data: dict = {
            "schema": "vramplan.harvest/1",
            "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "options": {"quick": options.quick, "skip_study": options.skip_study},
        }

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def section(self, name: str, value) -> None:
        self.data[name] = value
        self.data["seconds"] = round(self.elapsed(), 1)
        print(f"[{self.elapsed():6.1f} s] {name} done", flush=True)
        self.save()

    def save(self) -> None:
        if self.folder is None:
            return
        from benchmarks.gpu_harvest.report import markdown

        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "harvest.json").write_text(json.dumps(self.data, indent=1, default=str))
        (self.folder / "harvest.md").write_text(markdown(self.data))


def _device_and_stack(harvest: Harvest) -> bool:
    from benchmarks.gpu_harvest.measured_format import cudnn_text, slug

    children = [c for stages in harvest.data["floor"].values() for c in stages.values()]
    good = [c for c in children if "device" in c]
    if not good:
        return False
    versions = good[0]["versions"]
    idle = harvest.data["nvml_idle"]
    harvest.data["device"] = good[0]["device"]
    harvest.data["stack"] = {
        "torch": versions["torch"],
        "cuda": versions["cuda"],
        "cudnn": cudnn_text(versions["cudnn"]),
        "cudnn_raw": versions["cudnn"],
        "driver": idle.get("driver")
        or versions.get("driver")
        or harvest.data["smi_idle"].get("driver_version", ""),
    }
    if harvest.folder is None:
        stamp = datetime.date.today().isoformat()
        harvest.folder = RESULTS / f"gpu-{slug(good[0]['device']['name'])}-{stamp}"
    return True


def _conv(harvest: Harvest) -> dict:
    from benchmarks.gpu_harvest.child import run_child
    from benchmarks.gpu_harvest.conv_shapes import study_configs, workload_configs
    from benchmarks.gpu_harvest.conv_workspace import plan_cases
    from benchmarks.gpu_harvest.task_convs import load_task_configs

    quick, only_tasks = harvest.options.quick, harvest.options.task_convs_only
    plan = []
    if not only_tasks:
        batches = (32,) if quick else (32, 128)
        plan += plan_cases(study_configs(batches=batches), dtypes=("float32",))
    if not (quick or only_tasks):
        plan += plan_cases(study_configs(batches=(32, 128)), dtypes=("bfloat16",))
        plan += plan_cases(workload_configs(), dtypes=("float32",))
        # the published rows' middle batch last (the budget cuts it first): an interpolated
        # batch 64 missed VGG-16's reserved peak by 7% on both Hopper cards; then the same in
        # bf16, for the amp-bf16 rows at batch 64
        plan += plan_cases(study_configs(batches=(64,)), dtypes=("float32",))
        plan += plan_cases(study_configs(batches=(64,)), dtypes=("bfloat16",))
    # then the task rows' own calls (detection, segmentation, video, diffusion, timm), each
    # in the dtype its trace ran it (task_convs.json)
    if only_tasks or not quick:
        for config in load_task_configs():
            plan += plan_cases([config], dtypes=(config["dtype"],))
    budget = harvest.options.conv_budget_s or (45.0 if quick else 110.0)
    plan_path = harvest.folder / "conv_plan.json"
    plan_path.write_text(json.dumps(plan))
    out = {"plan_cases": len(plan), "budget_s_each": budget, "children": {}, "records": []}
    for benchmark in (0, 1):
        records_path = harvest.folder / f"conv_benchmark_{benchmark}.jsonl"
        records_path.unlink(missing_ok=True)
        args = ["-m", "benchmarks.gpu_harvest.conv_workspace", "--plan", str(plan_path)]
        args += ["--out", str(records_path), "--benchmark", str(benchmark)]
        child = run_child([*args, "--budget-s", str(budget)], timeout=budget + 150)
        out["children"][f"benchmark_{bool(benchmark)}"] = child
        if records_path.exists():
            out["records"] += [json.loads(line) for line in records_path.read_text().splitlines()]
    return out


def run(options: argparse.Namespace) -> int:
    from benchmarks.gpu_harvest import assemble, device_rows, floor, measured_format, nvml, study
    from benchmarks.gpu_harvest.child import run_child

    harvest = Harvest(options)
    index = nvml.visible_index()
    harvest.data["nvml_idle"] = nvml.read_nvml(index)  # before any CUDA process of ours
    harvest.data["smi_idle"] = nvml.query_smi(index)
    idle_used = harvest.data["nvml_idle"].get("v2_used")
    harvest.section("floor", floor.measure_floors(idle_used))
    if not _device_and_stack(harvest):
        first = next(iter(harvest.data["floor"].get("lazy", {}).values()), {})
        print(f"gpu_harvest: CUDA did not start: {first.get('error')}", file=sys.stderr)
        harvest.folder = harvest.folder or RESULTS / "gpu-unknown"
        harvest.save()
        return 1
    harvest.save()
    harvest.section("cublas", run_child(["-m", "benchmarks.gpu_harvest.cublas"], timeout=300))
    harvest.section("conv", _conv(harvest))
    harvest.section("calibrate", study.run_calibrate(harvest.folder / "profile"))
    try:
        data = assemble.measured_from(harvest.data)
        bundled = MEASURED / measured_format.file_name(data["gpu"], data["stack"])
        if options.task_convs_only and bundled.exists():
            data = measured_format.merged(json.loads(bundled.read_text()), data)
        path = measured_format.write_measured(data, options.measured_dir)
        harvest.section(
            "measured", {"path": str(path), "conv_records": len(data["conv_workspaces"])}
        )
    except (ValueError, KeyError, TypeError) as exc:
        harvest.section("measured", {"error": f"{type(exc).__name__}: {exc}"})
    if not options.skip_rows:
        left = options.budget_s - harvest.elapsed()
        jobs = 2 if harvest.data["device"].get("total_memory", 0) >= TWO_ROWS_AT_ONCE else 1
        rows = device_rows.measure_rows(harvest.folder / "rows", jobs, budget_s=left / 2)
        harvest.section("rows", rows)
    if not options.skip_study:
        timeout = max(120.0, options.budget_s - harvest.elapsed())
        harvest.section(
            "study",
            study.run_accuracy_study(
                harvest.folder / "accuracy", options.quick, timeout, options.jobs
            ),
        )
    print(f"wrote {harvest.folder / 'harvest.json'} and harvest.md")
    if "path" in harvest.data["measured"]:
        print(f"wrote {harvest.data['measured']['path']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    options = _parse(argv)
    if not _has_gpu():
        print(
            "gpu_harvest needs a CUDA GPU: torch.cuda.is_available() is False here",
            file=sys.stderr,
        )
        return 2
    return run(options)


if __name__ == "__main__":
    sys.exit(main())
