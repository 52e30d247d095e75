"""The GPU harvest's CPU-checkable parts: conv shapes on the meta device, snapshot
attribution, the measured-file format, NVML parsing, assembly, and the no-GPU refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # plain `pytest` runs too
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_harvest import assemble, cublas, report
from benchmarks.gpu_harvest.child import ROOT, run_child
from benchmarks.gpu_harvest.conv_shapes import (
    conv_configs,
    output_shape,
    shape_key,
    unique_configs,
)
from benchmarks.gpu_harvest.conv_workspace import DTYPES, conv_call, make_tensors, plan_cases
from benchmarks.gpu_harvest.floor import floor_figures
from benchmarks.gpu_harvest.measured_format import (
    SCHEMA,
    conv_key,
    cudnn_text,
    load_measured,
    slug,
    stack_slug,
    validate,
    write_measured,
)
from benchmarks.gpu_harvest.nvml import SMI_FIELDS, memory_summary, parse_smi
from benchmarks.gpu_harvest.snapshot import attribute, device_events

MiB = 2**20


# --- conv shapes on the meta device -------------------------------------------------------


def test_resnet18_unique_convs_and_first_conv():
    calls = conv_configs("resnet18", batch=32)
    assert len(calls) == 20  # conv1, 16 in the basic blocks, 3 downsamples
    unique = unique_configs(calls)
    # conv1; layer1's one 3x3; per later layer: strided 3x3, 3x3, 1x1 downsample
    assert len(unique) == 11
    first = unique[0]
    assert first["input"] == [32, 3, 224, 224]
    assert first["weight"] == [64, 3, 7, 7]
    assert (first["stride"], first["padding"], first["dilation"], first["groups"]) == (
        [2, 2],
        [3, 3],
        [1, 1],
        1,
    )
    assert output_shape(first) == [32, 64, 112, 112]
    downsample = [c for c in unique if c["weight"][2:] == [1, 1]]
    assert [(c["input"][1:], c["stride"]) for c in downsample] == [
        ([64, 56, 56], [2, 2]),
        ([128, 28, 28], [2, 2]),
        ([256, 14, 14], [2, 2]),
    ]


def test_vgg16_unique_convs_by_hand():
    calls = conv_configs("vgg16", batch=4)
    assert len(calls) == 13
    expected = [  # (in channels, out channels, spatial size): every conv is 3x3, stride 1, pad 1
        (3, 64, 224),
        (64, 64, 224),
        (64, 128, 112),
        (128, 128, 112),
        (128, 256, 56),
        (256, 256, 56),
        (256, 512, 28),
        (512, 512, 28),
        (512, 512, 14),
    ]
    unique = unique_configs(calls)
    assert [(c["input"][1], c["weight"][0], c["input"][2]) for c in unique] == expected
    for config in unique:
        assert config["input"][0] == 4 and config["weight"][2:] == [3, 3]
        assert config["stride"] == [1, 1] and config["padding"] == [1, 1]
        assert output_shape(config)[2:] == config["input"][2:]


def test_unique_configs_name_every_model_that_uses_them():
    calls = conv_configs("resnet18", 8, (3, 64, 64)) + conv_configs("resnet50", 8, (3, 64, 64))
    unique = unique_configs(calls)
    stem = next(c for c in unique if c["weight"] == [64, 3, 7, 7])
    assert stem["models"] == ["resnet18", "resnet50"]
    assert len({shape_key(c) for c in unique}) == len(unique)


def test_depthwise_groups_and_pass_shapes_on_cpu():
    unique = unique_configs(conv_configs("mobilenet_v2", 2, (3, 32, 32)))
    depthwise = [c for c in unique if c["groups"] > 1]
    assert depthwise and all(c["groups"] == c["input"][1] == c["weight"][0] for c in depthwise)
    config = depthwise[0]
    x, weight, grad = make_tensors(config, torch.float32, "channels_last", "cpu")
    assert list(conv_call("forward", x, weight, grad, config)().shape) == output_shape(config)
    grad_input, grad_weight, _ = conv_call("backward_data", x, weight, grad, config)()
    assert grad_input.shape == x.shape and grad_weight is None
    grad_input, grad_weight, _ = conv_call("backward_filter", x, weight, grad, config)()
    assert grad_input is None and grad_weight.shape == weight.shape


def test_plan_cases_batch_then_dtype_order():
    configs = [
        {"input": [b, 3, 8, 8], "weight": [4, 3, 3, 3], "stride": [1, 1], "padding": [1, 1],
         "dilation": [1, 1], "groups": 1, "models": ["m"]}
        for b in (32, 128)
    ]  # fmt: skip
    cases = plan_cases(configs, dtypes=("float32", "bfloat16"))
    assert [(c["input"][0], c["dtype"]) for c in cases] == [
        (32, "float32"),
        (32, "bfloat16"),
        (128, "float32"),
        (128, "bfloat16"),
    ]


# --- snapshot attribution -----------------------------------------------------------------


def _event(action, addr, size, stream=0, **extra):
    return {"action": action, "addr": addr, "size": size, "stream": stream, **extra}


def test_workspace_freed_inside_the_window_is_found_and_output_is_not():
    workspace, output = 123_456_789, 7 * MiB
    events = [
        _event("segment_alloc", 0x7F0000000000, 124 * MiB),
        _event("alloc", 0x7F0000000000, workspace, frames=[{"name": "cudnn", "line": 1}]),
        _event("segment_alloc", 0x7F1000000000, 8 * MiB),
        _event("alloc", 0x7F1000000000, output),
        _event("alloc", 0x7F1000800000, 4096),  # a small transient too
        _event("free_requested", 0x7F1000800000, 4096),
        _event("free_completed", 0x7F1000800000, 4096),
        _event("free_requested", 0x7F0000000000, workspace),
        _event("free_completed", 0x7F0000000000, workspace),
    ]
    window = attribute(events)
    assert window.workspace_bytes == workspace
    assert [size for _, size in window.transient] == [workspace, 4096]
    assert window.live == ((0x7F1000000000, output),)
    assert window.live_bytes == output
    assert window.segment_bytes == 132 * MiB
    assert not window.cache_emptied and not window.oom
    assert window.live_except([0x7F1000000000]) == []


def test_only_output_means_no_workspace_and_earlier_frees_are_apart():
    events = [
        _event("free_requested", 0x10, 2048),  # a block allocated before the window
        _event("free_completed", 0x10, 2048),
        _event("alloc", 0x20, 1024),
    ]
    window = attribute(events)
    assert window.workspace_bytes == 0
    assert window.live_bytes == 1024
    assert window.freed_earlier_bytes == 2048
    assert window.segment_bytes == 0


def test_address_reuse_inside_the_window():
    events = [
        _event("alloc", 0x40, 3 * MiB),
        _event("free_requested", 0x40, 3 * MiB),
        _event("alloc", 0x40, MiB),  # same address, now the output
    ]
    window = attribute(events)
    assert window.workspace_bytes == 3 * MiB
    assert window.live == ((0x40, MiB),)


@pytest.mark.parametrize("release", ["segment_free", "empty_cache", "segment_unmap"])
def test_released_segments_set_cache_emptied(release):
    events = [
        _event("alloc", 0x100, 40 * MiB),
        _event("free_requested", 0x100, 40 * MiB),
        _event("free_completed", 0x100, 40 * MiB),
        _event(release, 0x100, 40 * MiB),
        _event("segment_alloc", 0x200, 20 * MiB),
        _event("alloc", 0x200, 10 * MiB),
    ]
    window = attribute(events)
    assert window.cache_emptied
    assert window.released_bytes == 40 * MiB
    assert window.segment_bytes == 20 * MiB
    assert window.workspace_bytes == 40 * MiB


def test_window_bounds_oom_and_device_events():
    events = [
        _event("alloc", 0x1, 5 * MiB),
        _event("free_requested", 0x1, 5 * MiB),
        {"action": "oom", "size": 99 * MiB, "stream": 0, "device_free": 0},
        _event("alloc", 0x2, MiB),
    ]
    assert attribute(events, start=3).workspace_bytes == 0
    assert attribute(events, end=2).workspace_bytes == 5 * MiB
    assert attribute(events).oom and not attribute(events, end=2).oom
    snapshot = {"segments": [], "device_traces": [events]}
    assert device_events(snapshot, 0) == events and device_events(snapshot, 1) == []
    assert attribute(events).to_json()["transient_bytes"] == [5 * MiB]


# --- the measured-file format --------------------------------------------------------------


def _conv_record(**change):
    record = {
        "pass": "backward_filter",
        "dtype": "float32",
        "memory_format": "contiguous",
        "input": [32, 3, 224, 224],
        "weight": [64, 3, 7, 7],
        "stride": [2, 2],
        "padding": [3, 3],
        "dilation": [1, 1],
        "groups": 1,
        "benchmark": False,
        "workspace_bytes": 12 * MiB,
        "reserved_growth_bytes": 20 * MiB,
        "cache_emptied": False,
    }
    return {**record, **change}


def _measured(**change):
    data = {
        "schema": SCHEMA,
        "gpu": "NVIDIA H100 80GB HBM3",
        "compute_capability": "9.0",
        "stack": {"torch": "2.14.1", "cuda": "12.8", "cudnn": "9.10.2", "driver": "570.86.15"},
        "floor": {"lazy": {"init": 500 * MiB, "gemm": 540 * MiB}, "eager": {"init": None}},
        "nvml": {
            "v1_used_idle": 560 * MiB,
            "v2_used_idle": 0,
            "driver_reserved_bytes": 560 * MiB,
            "total_bytes": 80 * 1024 * MiB,
        },
        "cublas": {
            "cublas_workspace_bytes": 32 * MiB,
            "cublaslt_workspace_bytes": MiB,
            "per_handle": {"default_stream_fp32": 33 * MiB},
        },
        "conv_workspaces": [_conv_record(), _conv_record(pass_name_unused=1)],
    }
    data["conv_workspaces"][1].pop("pass_name_unused")
    data["conv_workspaces"][1]["pass"] = "forward"
    return {**data, **change}


def test_measured_file_round_trips(tmp_path):
    data = _measured()
    path = write_measured(data, tmp_path)
    assert path.name == "nvidia-h100-80gb-hbm3-torch2.14-cu12.8-cudnn9.10.json"
    assert load_measured(path) == data


@pytest.mark.parametrize(
    ("breaks", "named"),
    [
        (lambda d: d.pop("cublas"), "'cublas'"),
        (lambda d: d["stack"].pop("cudnn"), "stack.cudnn"),
        (lambda d: d["nvml"].pop("total_bytes"), "nvml.total_bytes"),
        (lambda d: d["conv_workspaces"][1].pop("workspace_bytes"), "conv_workspaces[1]"),
        (lambda d: d["conv_workspaces"][0].update(input=[3, 224, 224]), "input"),
        (lambda d: d["conv_workspaces"][0].update(benchmark=1), "benchmark"),
        (lambda d: d["conv_workspaces"][0].update(groups=True), "groups"),
        (lambda d: d["conv_workspaces"][0].update({"pass": "backward"}), "pass"),
        (lambda d: d.update(schema="vramplan.measured/0"), "schema"),
        (lambda d: d["floor"]["lazy"].update(init="500MiB"), "floor.lazy.init"),
    ],
)
def test_malformed_measured_file_is_one_clear_value_error(tmp_path, breaks, named):
    data = _measured()
    breaks(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as error:
        load_measured(path)
    message = str(error.value)
    assert named in message and "\n" not in message and str(path) in message


def test_unreadable_measured_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        load_measured(path)
    with pytest.raises(ValueError, match="cannot read"):
        load_measured(tmp_path / "missing.json")


def test_conv_key_equal_for_equal_configs():
    a = _conv_record()
    b = _conv_record(workspace_bytes=0, reserved_growth_bytes=0, cache_emptied=True)
    b["input"] = tuple(b["input"])  # a tuple and a list of the same shape are one config
    assert conv_key(a) == conv_key(b)
    assert len({conv_key(a), conv_key(b)}) == 1
    assert conv_key(a) != conv_key(_conv_record(benchmark=True))
    assert conv_key(a) != conv_key(_conv_record(pass_="x", dtype="bfloat16"))
    assert conv_key(a) != conv_key(_conv_record(stride=[1, 1]))


def test_slugs():
    assert slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert slug("  NVIDIA A100-SXM4-40GB ") == "nvidia-a100-sxm4-40gb"
    assert stack_slug("2.14.1+cu130", "12.8", 91002) == "torch2.14-cu12.8-cudnn9.10"
    assert cudnn_text(8902) == "8.9.2" and cudnn_text(91002) == "9.10.2"


# --- NVML ---------------------------------------------------------------------------------


def test_driver_reserved_is_v1_used_minus_v2_used():
    v1 = SimpleNamespace(total=80 * 1024 * MiB, used=530 * MiB, free=80 * 1024 * MiB - 530 * MiB)
    v2 = SimpleNamespace(total=80 * 1024 * MiB, used=4 * MiB, free=v1.free, reserved=526 * MiB)
    summary = memory_summary(v1, v2)
    assert summary["driver_reserved_bytes"] == 526 * MiB
    assert summary["v2_reserved"] == 526 * MiB
    assert summary["v1_used"] == 530 * MiB and summary["v1_total"] == 80 * 1024 * MiB


def test_driver_reserved_without_v2_or_from_reserved_alone():
    v1 = SimpleNamespace(total=16 * 1024 * MiB, used=450 * MiB, free=0)
    assert memory_summary(v1, None)["driver_reserved_bytes"] is None
    v2_only = SimpleNamespace(total=1, used=None, free=0, reserved=300 * MiB)
    assert memory_summary(v1, v2_only)["driver_reserved_bytes"] == 300 * MiB


def test_parse_nvidia_smi_with_and_without_reserved():
    rows = parse_smi("570.86.15, 531, 81559, 528\n", SMI_FIELDS)
    assert rows == [
        {"driver_version": "570.86.15", "memory.used": 531, "memory.total": 81559,
         "memory.reserved": 528}
    ]  # fmt: skip
    assert parse_smi("550.54, 4, 81559, [N/A]", SMI_FIELDS)[0]["memory.reserved"] is None
    assert parse_smi("550.54, 4, 81559", SMI_FIELDS[:3])[0]["memory.total"] == 81559


def test_floor_figures_prefer_nvml_process_then_mem_get_info():
    child = {"process_used": 600 * MiB, "meminfo_used": 700 * MiB, "reserved": 2 * MiB}
    assert floor_figures(child, idle_used=4 * MiB)["floor_bytes"] == 598 * MiB
    child["process_used"] = None
    figures = floor_figures(child, idle_used=4 * MiB)
    assert figures["source"] == "mem_get_info" and figures["floor_bytes"] == 694 * MiB
    assert floor_figures({"error": "x"}, None)["floor_bytes"] is None


# --- cuBLAS, assembly and report ----------------------------------------------------------


def test_cublas_workspace_kind_from_innermost_library_frame():
    assert cublas.classify([{"name": "at::cuda::getCUDABlasLtWorkspace()"}]) == "cublasLt"
    frames = [
        {"name": "c10::cuda::CUDACachingAllocator::NativeCachingAllocator::malloc"},
        {"name": "at::cuda::(anonymous namespace)::getNewWorkspace()"},
        {"name": "at::cuda::getCUDABlasLtWorkspace()"},
    ]
    assert cublas.classify(frames) == "cublas"
    assert cublas.classify(None) == "unknown"


def _harvest():
    base = {k: v for k, v in _conv_record().items() if k not in ("workspace_bytes",)}
    records = [
        {**base, "call": 1, "workspace_bytes": 300 * MiB, "cache_emptied": True,
         "benchmark": True, "oom": None},
        {**base, "call": 2, "workspace_bytes": 12 * MiB, "cache_emptied": False,
         "benchmark": True, "oom": None},
        {**base, "pass": "forward", "call": 1, "workspace_bytes": 0, "oom": "CUDA out of memory"},
        {**{k: v for k, v in base.items() if k != "pass"}, "setup_oom": "CUDA out of memory"},
    ]  # fmt: skip
    return {
        "device": {"name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0",
                   "total_memory": 85 * 10**9},
        "stack": {"torch": "2.14.1", "cuda": "12.8", "cudnn": "9.10.2", "driver": "570.86"},
        "nvml_idle": {"v1_used": 531 * MiB, "v2_used": 4 * MiB,
                      "driver_reserved_bytes": 527 * MiB, "v1_total": 80 * 1024 * MiB},
        "floor": {"lazy": {"init": {"floor_bytes": 500 * MiB, "process_bytes": 502 * MiB}}},
        "cublas": {"cases": [
            {"case": "default_stream_fp32", "workspace_bytes": 33 * MiB, "allocated_growth": 0,
             "workspaces": [{"bytes": 32 * MiB, "kind": "cublas"},
                            {"bytes": MiB, "kind": "cublasLt"}]},
        ]},
        "conv": {"records": records, "children": {"benchmark_True": {"cases_done": 1,
                                                                    "cases_planned": 2}}},
    }  # fmt: skip


def test_assembled_measured_file_validates_and_merges_calls(tmp_path):
    data = assemble.measured_from(_harvest())
    validate(data)
    assert data["cublas"]["cublas_workspace_bytes"] == 32 * MiB
    assert data["cublas"]["cublaslt_workspace_bytes"] == MiB
    assert data["nvml"]["driver_reserved_bytes"] == 527 * MiB
    assert data["floor"] == {"lazy": {"init": 500 * MiB}}
    [conv] = data["conv_workspaces"]  # the OOM and the setup OOM are left out
    assert conv["workspace_bytes"] == 300 * MiB and conv["cache_emptied"]
    assert conv["cached_workspace_bytes"] == 12 * MiB
    assert load_measured(write_measured(data, tmp_path)) == data


def test_report_has_every_section_even_when_partial():
    text = report.markdown(_harvest())
    for heading in ("Device and stack", "Process floor", "cuBLAS", "cuDNN convolution"):
        assert f"## {heading}" in text
    assert "300.0" in text  # the largest workspace, in MiB
    assert "GPU harvest" in report.markdown({})


# --- the command ---------------------------------------------------------------------------


def test_child_json_round_trip():
    code = "from benchmarks.gpu_harvest.child import emit; print('noise'); emit({'a': [1]})"
    assert run_child(["-c", code]) == {"a": [1]}
    assert "error" in run_child(["-c", "raise SystemExit(3)"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_command_refuses_cleanly_without_a_gpu():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    before = sorted(Path(ROOT, "src", "vramplan", "data").glob("measured/*.json"))
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_harvest", "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "CUDA GPU" in lines[0]
    assert "Traceback" not in done.stderr
    assert sorted(Path(ROOT, "src", "vramplan", "data").glob("measured/*.json")) == before


def test_measure_case_records_every_pass_twice_with_stubbed_recording(monkeypatch):
    """The conv child's bookkeeping, with the allocator recording replaced by a stub that
    reports one 3 MiB workspace per call (the real one needs a GPU)."""
    from functools import partial

    from benchmarks.gpu_harvest import conv_workspace, recording
    from benchmarks.gpu_harvest.snapshot import attribute

    def fake_record_call(call, frames=False):
        result = call()
        events = [
            {"action": "alloc", "addr": 1, "size": 3 * MiB, "stream": 0},
            {"action": "free_requested", "addr": 1, "size": 3 * MiB, "stream": 0},
        ]
        facts = {"window": attribute(events), "events": events, "peak_reserved_growth": 4 * MiB,
                 "peak_allocated_growth": 3 * MiB, "oom": None, "seconds": 0.0,
                 "wrapped": False}  # fmt: skip
        return result, facts

    monkeypatch.setattr(recording, "record_call", fake_record_call)
    monkeypatch.setattr(
        conv_workspace, "make_tensors", partial(conv_workspace.make_tensors, device="cpu")
    )
    [case] = plan_cases(unique_configs(conv_configs("resnet18", 1, (3, 32, 32)))[:1])
    records = conv_workspace.measure_case(case, benchmark=True)
    assert [(r["pass"], r["call"]) for r in records] == [
        (p, c) for p in ("forward", "backward_data", "backward_filter") for c in (1, 2)
    ]
    data = assemble.conv_records(records)
    assert len(data) == 3
    assert all(r["workspace_bytes"] == 3 * MiB and r["cached_workspace_bytes"] == 3 * MiB
               for r in data)  # fmt: skip
    json.dumps(records)  # every record is plain JSON


def test_a_device_row_is_a_real_measure_run_that_gpu_table_reads(tmp_path):
    """One row through the real CLI (on this machine's device) and back through the table's
    reader; the rows the budget leaves no time for are recorded, not run."""
    from benchmarks.accuracy.gpu_table import measure_rows as read_rows
    from benchmarks.gpu_harvest.device_rows import DEVICE_ROWS, DeviceRow, measure_rows

    model_file = tmp_path / "mlp.py"
    model_file.write_text(
        "from torch import nn\n"
        "def mlp():\n"
        "    return nn.Sequential(nn.Linear(64, 256), nn.ReLU())\n"
    )
    tiny = DeviceRow("mlp", f"{model_file}:mlp", ("-b", "4", "-o", "sgd"))
    (result,) = measure_rows(tmp_path / "rows", jobs=2, budget_s=300, rows=(tiny,))
    assert "error" not in result, result
    (row,) = read_rows(tmp_path / "rows")
    assert row.name == "mlp" and row.recipe.batch_size == 4 and row.measured["allocated"] > 0
    skipped = measure_rows(tmp_path / "late", jobs=2, budget_s=10, rows=DEVICE_ROWS[:3])
    assert [r["error"] for r in skipped] == ["skipped: the budget was spent"] * 3
    assert not (tmp_path / "late").exists()
    assert len({r.name for r in DEVICE_ROWS}) == len(DEVICE_ROWS)


def test_every_device_row_parses_as_measure_and_matches_its_committed_h200_run():
    """The harvest's rows are real ``vramplan measure`` command lines; the recipes first run
    by hand on the H200 are the same runs the committed rows hold, so the next card's
    harvest measures what the H200 measured."""
    from pathlib import Path

    import typer

    from benchmarks.accuracy.gpu_table import measure_rows as read_rows
    from benchmarks.gpu_harvest.device_rows import DEVICE_ROWS, RECIPES
    from vramplan.cli import app, register_commands

    register_commands()
    measure = typer.main.get_command(app).commands["measure"]
    folder = Path(__file__).resolve().parents[1] / "benchmarks/results"
    committed = {r.name: r for r in read_rows(folder / "gpu-nvidia-h200-2026-11-27-fresh/rows")}
    for row in DEVICE_ROWS:
        params = measure.make_context("measure", [row.model, *row.args]).params
        if row in RECIPES:
            recipe = committed[row.name].recipe
            assert (params["batch_size"], params["precision"], params["checkpointing"]) == (
                recipe.batch_size,
                recipe.precision,
                recipe.checkpointing,
            ), row.name
            assert params["lora"] == recipe.lora_rank, row.name


# --- 3-d convolutions and the task rows' own configurations --------------------------------

VIDEO_STEM = {  # torchvision's r3d_18 stem on a clip of 4 frames
    "input": [2, 3, 4, 16, 16],
    "weight": [8, 3, 3, 7, 7],
    "stride": [1, 2, 2],
    "padding": [1, 3, 3],
    "dilation": [1, 1, 1],
    "groups": 1,
}


def test_3d_pass_shapes_on_cpu():
    x, weight, grad = make_tensors(VIDEO_STEM, torch.float32, "contiguous", "cpu")
    assert output_shape(VIDEO_STEM) == [2, 8, 4, 8, 8]
    out = conv_call("forward", x, weight, grad, VIDEO_STEM)()
    assert torch.allclose(out, torch.nn.functional.conv3d(x, weight, None, (1, 2, 2), (1, 3, 3)))
    grad_input, _, _ = conv_call("backward_data", x, weight, grad, VIDEO_STEM)()
    _, grad_weight, _ = conv_call("backward_filter", x, weight, grad, VIDEO_STEM)()
    assert grad_input.shape == x.shape and grad_weight.shape == weight.shape


def test_3d_records_validate_and_a_mixed_one_is_refused(tmp_path):
    record = _conv_record(**VIDEO_STEM)
    data = _measured(conv_workspaces=[record])
    assert load_measured(write_measured(data, tmp_path)) == data
    mixed = _measured(conv_workspaces=[{**record, "stride": [2, 2]}])
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(mixed))
    with pytest.raises(ValueError, match="input should be 4 integers"):
        load_measured(path)


def test_a_later_harvest_keeps_the_records_it_did_not_rerun():
    from benchmarks.gpu_harvest.measured_format import merged

    old = _measured()
    new = _measured(conv_workspaces=[_conv_record(**VIDEO_STEM)])
    kept = merged(old, new)["conv_workspaces"]
    assert len(kept) == len(old["conv_workspaces"]) + 1 and kept[-1]["input"] == [2, 3, 4, 16, 16]


def test_task_convs_are_the_traced_calls_of_the_task_rows():
    """The committed configurations hold torchvision's R3D-18 stem at the row's clip
    (8 x 3 x 16 x 112 x 112) and DeepLabV3's dilated 3x3 convolutions, each valid for the
    harvest (2-d or 3-d, the lengths matching) and named by the rows that run it."""
    from benchmarks.gpu_harvest.task_convs import load_task_configs
    from benchmarks.gpu_harvest.task_rows import TASK_ROWS

    configs = load_task_configs()
    names = {row.name for row in TASK_ROWS}
    stem = [c for c in configs if c["weight"] == [64, 3, 3, 7, 7]]
    assert (
        stem and stem[0]["input"] == [8, 3, 16, 112, 112] and stem[0]["models"] == ["r3d18-b8-f16"]
    )
    dilated = [
        c for c in configs if "deeplabv3-r50-b4-512" in c["models"] and c["dilation"] != [1, 1]
    ]
    assert dilated and all(c["weight"][2:] == [3, 3] for c in dilated)
    for config in configs:
        spatial = len(config["stride"])
        assert spatial in (2, 3) and len(config["input"]) == len(config["weight"]) == spatial + 2
        assert set(config["models"]) <= names and config["dtype"] in DTYPES
