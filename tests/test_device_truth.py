"""The device-level truth: cuDNN workspaces per call as PyTorch runs them, measured tables
replacing the model, the [low, high] range the verdict reads, and the driver reserve."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from torch import nn

from vramplan.device.alloc_conf import AllocatorConfig
from vramplan.device.allocator import replay
from vramplan.device.catalog import lookup_gpu
from vramplan.device.cudnn import ConvCase, engine_workspace
from vramplan.device.measured import MEASURED_DIR_ENV
from vramplan.device.options import device_options
from vramplan.device.replay import device_trace, requests_of
from vramplan.device.verdict import judge
from vramplan.session import Session
from vramplan.trace.events import Allocation, PhaseMark, Trace
from vramplan.trace.recorder import OpMarker

MiB = 2**20
A100 = lookup_gpu("a100-40gb")
X = (8, 64, 56, 56)
W = (64, 64, 3, 3)


def _conv_trace(calls: list[tuple[str, tuple[str, ...]]], shape=X, weight=W, stride=(1, 1)):
    """A hand-written trace: one output storage per convolution call, each followed by
    its marker."""
    allocations, markers = [], []
    nbytes = 4 * shape[0] * shape[1] * shape[2] * shape[3]
    for i, (phase, passes) in enumerate(calls):
        allocations.append(Allocation(i, nbytes, "activations", phase, 1, "", "conv", i, None))
        markers.append(
            OpMarker(
                i,
                phase,
                "convolution",
                nbytes,
                nbytes,
                input_shape=shape,
                weight_shape=weight,
                output_shape=shape,
                stride=stride,
                padding=(1, 1),
                dilation=(1, 1),
                groups=1,
                dtype="float32",
                passes=passes,
            )
        )
    return Trace(
        tuple(allocations), (PhaseMark(0, "forward", 1),), len(calls), markers=tuple(markers)
    )


def _case(pass_="forward", shape=X, weight=W, stride=(1, 1)):
    return ConvCase(pass_, "float32", "contiguous", shape, weight, stride, (1, 1), (1, 1), 1)


def _workspace_requests(requests, trace):
    """(kind, size) of the requests the device model added to a trace."""
    own = {a.id for a in trace.allocations}
    out = []
    for r in requests:
        if r.key in own:
            continue
        kind = "empty_cache" if r.empty_cache else "alloc" if r.is_alloc else "free"
        out.append((kind, r.candidates or r.size))
    return out


def test_benchmark_off_one_workspace_per_call_sized_by_the_engine_rule():
    trace = _conv_trace(
        [
            ("forward", ("forward",)),
            ("forward", ("forward",)),
            ("backward", ("backward_data", "backward_filter")),
        ]
    )
    on = device_trace(trace, A100, cudnn_benchmark=False)
    fwd = engine_workspace(_case()).central
    dgrad = engine_workspace(_case("backward_data")).central
    wgrad = engine_workspace(_case("backward_filter")).central
    # dense 3x3 stride 1: Winograd non-fused, 2.25x input and output + 4x filters
    x = 4 * 8 * 64 * 56 * 56
    assert fwd == int(2.25 * (x + x) + 4 * 4 * 64 * 64 * 9)
    assert _workspace_requests(requests_of(on), trace) == [
        ("alloc", fwd),
        ("free", fwd),
        ("alloc", fwd),
        ("free", fwd),
        ("alloc", dgrad),
        ("free", dgrad),
        ("alloc", wgrad),
        ("free", wgrad),
    ]
    # a 1x1 convolution runs implicit GEMM: no workspace at all
    pointwise = _conv_trace([("forward", ("forward",))], weight=(64, 64, 1, 1))
    assert _workspace_requests(requests_of(device_trace(pointwise, A100, False)), pointwise) == []
    # the low and high readings bracket the central one
    low = device_trace(trace, A100, False, "low")
    assert _workspace_requests(requests_of(low), trace) == []
    assert engine_workspace(_case()).high >= fwd


def test_benchmark_on_searches_once_then_empties_the_cache():
    trace = _conv_trace([("forward", ("forward",)), ("forward", ("forward",))])
    on = device_trace(trace, A100, cudnn_benchmark=True)
    requests = requests_of(on)
    workspace = engine_workspace(_case())
    added = _workspace_requests(requests, trace)
    assert added == [
        ("alloc", workspace.candidates),
        ("free", max(workspace.candidates)),
        ("empty_cache", 0),
        ("alloc", workspace.central),
        ("free", workspace.central),
        # the second call of the same configuration: the cached plan's size, no search
        ("alloc", workspace.central),
        ("free", workspace.central),
    ]
    config = AllocatorConfig()
    position = {kind: i for i, kind in reversed(list(enumerate(k for k, _ in added)))}
    first_own = len(requests) - len(added)  # hand trace: its own allocations come first
    after_find = replay(requests[: first_own + 1], config).stats
    after_empty = replay(requests[: first_own + position["empty_cache"] + 1], config).stats
    assert after_find.reserved >= max(workspace.candidates)
    assert after_empty.reserved < after_find.reserved  # the search's segment is released
    # the search takes the largest candidate that fits max(device free, largest free block)
    squeezed = replay(
        requests[: first_own + 1],
        config,
        device_free=after_empty.reserved + workspace.central + 4 * MiB,
    ).stats
    assert squeezed.peak_reserved < after_find.peak_reserved


def _measured_file(folder, stack, workspace, reserve):
    case = {
        "pass": "forward",
        "dtype": "float32",
        "memory_format": "contiguous",
        "input": list(X),
        "weight": list(W),
        "stride": [1, 1],
        "padding": [1, 1],
        "dilation": [1, 1],
        "groups": 1,
        "benchmark": False,
        "workspace_bytes": workspace,
        "reserved_growth_bytes": workspace,
        "cache_emptied": False,
    }
    data = {
        "schema": "vramplan.measured/1",
        "gpu": "A100-40GB",
        "compute_capability": "8.0",
        "stack": {"torch": stack[0], "cuda": stack[1], "cudnn": "9.1.0", "driver": "550.54"},
        "floor": {"lazy": {"init": 500 * MiB}},
        "nvml": {
            "v1_used_idle": reserve,
            "v2_used_idle": 0,
            "driver_reserved_bytes": reserve,
            "total_bytes": 40960 * MiB,
        },
        "cublas": {},
        "conv_workspaces": [case],
    }
    path = folder / f"a100-40gb-torch{stack[0]}-cu{stack[1]}.json"
    path.write_text(json.dumps(data))
    return path


def test_a_measured_table_replaces_the_model_for_its_card_and_stack(tmp_path, monkeypatch):
    monkeypatch.setenv(MEASURED_DIR_ENV, str(tmp_path))
    _measured_file(tmp_path, ("2.5", "12.4"), 3 * MiB, 300 * MiB)
    trace = _conv_trace([("forward", ("forward",))])
    options = device_options(gpu="a100-40gb", stack="torch2.5-cu12.4")
    assert options.measured is not None
    on = device_trace(trace, A100, False, "high", options.measured)
    assert _workspace_requests(requests_of(on), trace) == [("alloc", 3 * MiB), ("free", 3 * MiB)]
    # another CUDA, or a card of another architecture, keeps the model; another PyTorch on
    # the same CUDA, or a sibling card, takes the table as its central reading only
    assert device_options(gpu="a100-40gb", stack="torch2.5-cu12.1").measured is None
    assert device_options(gpu="a10", stack="torch2.5-cu12.4").measured is None
    assert device_options(gpu="a100-40gb", stack="torch2.6-cu12.4").measured.exact is False
    assert device_options(gpu="a100-80gb", stack="torch2.5-cu12.4").measured.sibling
    model = device_trace(trace, A100, False)
    assert _workspace_requests(requests_of(model), trace)[0] == (
        "alloc",
        engine_workspace(_case()).central,
    )


def _estimate(**options):
    import torch

    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )
    session = Session(model, example_batch=torch.randn(8, 3, 32, 32), **options)
    return session.estimate(batch_size=8)


def test_the_range_brackets_the_figure_and_the_verdict_reads_its_high_end(tmp_path, monkeypatch):
    monkeypatch.setenv(MEASURED_DIR_ENV, str(tmp_path))
    est = _estimate(gpu="a100-40gb", stack="torch2.5-cu12.4")
    peak = est.peak
    low, high = peak.device_total_range_bytes
    assert low <= peak.device_total_bytes <= high and low < high
    r_low, r_high = peak.reserved_range_bytes
    assert r_low <= peak.reserved_bytes <= r_high
    assert est.details["range"]["widest"] in est.details["range"]["terms"]
    json_peak = est.to_json()["peak"]
    assert json_peak["device_total_range_bytes"] == [low, high]
    # central fits under the usable line, the high end does not: not FITS
    capacity = 10 * 2**30
    assert judge("card", capacity, 0.1, 8 * 2**30).status == "fits"
    assert judge("card", capacity, 0.1, 8 * 2**30, high=int(9.5 * 2**30)).status == "tight"
    assert judge("card", capacity, 0.1, 11 * 2**30, high=12 * 2**30).status == "oom"
    # the same on a card sized between the central figure and the high end
    reserve = est.runtime["driver_reserved"]
    job_central = peak.device_total_bytes - reserve
    job_high = high - reserve
    size = (job_central + job_high) // 2
    between = _estimate(gpu_memory=f"{size}B", headroom=0.0, stack="torch2.5-cu12.4")
    assert between.verdict.status == "tight"
    assert between.verdict.compared_bytes == between.peak.device_total_range_bytes[1]


def test_the_driver_reserve_changes_the_usable_capacity(tmp_path, monkeypatch):
    monkeypatch.setenv(MEASURED_DIR_ENV, str(tmp_path))
    est = _estimate(gpu="a100-40gb", stack="torch2.5-cu12.4")
    assert est.runtime["driver_reserved"] == 424 * MiB
    assert est.verdict.capacity_bytes == A100.total_bytes - 424 * MiB
    v2 = _estimate(gpu="a100-40gb", stack="torch2.5-cu12.4", used_counter="nvml-v2")
    assert est.peak.device_total_bytes - v2.peak.device_total_bytes == 424 * MiB
    assert v2.verdict == est.verdict  # the counter changes the figure, not the verdict
    # a measured table's reserve replaces the table's figure
    _measured_file(tmp_path, ("2.5", "12.4"), 0, 300 * MiB)
    measured = _estimate(gpu="a100-40gb", stack="torch2.5-cu12.4")
    assert measured.runtime["driver_reserved"] == 300 * MiB
    assert measured.verdict.capacity_bytes == 40960 * MiB - 300 * MiB
    assert measured.runtime["cuda_context"] == 500 * MiB
    assert any("measured figures" in note for note in measured.notes)


def test_a_sibling_cards_table_gives_its_workspaces_and_floor_not_its_memory(tmp_path, monkeypatch):
    """An A100-80GB without a table of its own takes the A100-40GB's (same sm80, same CUDA)
    as its central reading: the measured workspace and context, its own 80 GB and reserve."""
    monkeypatch.setenv(MEASURED_DIR_ENV, str(tmp_path))
    _measured_file(tmp_path, ("2.5", "12.4"), 3 * MiB, 300 * MiB)
    options = device_options(gpu="a100-80gb", stack="torch2.5-cu12.4")
    table = options.measured
    assert table.sibling and not table.exact and table.nvml == {}
    trace = _conv_trace([("forward", ("forward",))])
    on = device_trace(trace, lookup_gpu("a100-80gb"), False, "central", table)
    assert _workspace_requests(requests_of(on), trace)[0] == ("alloc", 3 * MiB)
    own = _estimate(gpu="a100-40gb", stack="torch2.5-cu12.4")
    sibling = _estimate(gpu="a100-80gb", stack="torch2.5-cu12.4")
    assert sibling.runtime["cuda_context"] == own.runtime["cuda_context"] == 500 * MiB
    assert own.runtime["driver_reserved"] == 300 * MiB
    assert sibling.runtime["driver_reserved"] == 450 * MiB  # the catalog's, not the table's
    assert sibling.verdict.capacity_bytes == lookup_gpu("a100-80gb").total_bytes - 450 * MiB
    assert any("A100-40GB's (sm80" in note for note in sibling.notes)


def test_the_h100_and_h200_harvests_measured_the_same_cudnn_workspaces():
    """Two sm90 cards of different memory on one stack: the ground truth for siblings."""
    import os

    from vramplan.device.measured import _read, measured_for

    h100, h200 = (
        measured_for("H100-SXM", "torch2.11-cu13.0"),
        measured_for("H200", "torch2.11-cu13.0"),
    )
    assert h100.exact and h200.exact and not h100.sibling
    h100, h200 = (_read(t.path, os.stat(t.path).st_mtime_ns) for t in (h100, h200))  # as run
    shared = [k for k in h100.workspaces if k in h200.workspaces and not k[-1]]
    same = [k for k in shared if h100.workspaces[k] == h200.workspaces[k]]
    assert len(shared) > 1500 and len(same) >= len(shared) - 1
    lazy = h100.floor["lazy"]  # the lazy floors of every stage both harvests ran are equal
    assert lazy and all(lazy[stage] == h200.floor["lazy"][stage] for stage in lazy)
    assert h100.nvml["driver_reserved_bytes"] != h200.nvml["driver_reserved_bytes"]
    pcie, sxm = (measured_for(card, "torch2.11-cu13.0") for card in ("H100-PCIe", "H100-SXM"))
    assert pcie.sibling and pcie.workspaces == sxm.workspaces  # both cards' records, merged


def test_a_cards_table_takes_the_configurations_it_lacks_from_a_sibling_of_its_stack():
    """The H100 harvest ran vgg16 at batch 32 and 128 only, the later H200 harvest also at
    64: the H100's table answers batch 64 with the H200's measurement (the two cards agreed
    on 1559 of 1560 shared configurations), keeping its own records where it has them; the
    same for a floor stage only the later harvest ran."""
    import os

    from vramplan.device.measured import _read, measured_for

    h100, h200 = (measured_for(card, "torch2.11-cu13.0") for card in ("H100-SXM", "H200"))
    own = _read(h100.path, os.stat(h100.path).st_mtime_ns)
    case = ConvCase("backward_filter", "float32", "contiguous", (64, 64, 224, 224),
                    (64, 64, 3, 3), (1, 1), (1, 1), (1, 1), 1)  # fmt: skip
    key = _table_key(case)
    assert key not in own.workspaces and key in h200.workspaces
    assert h100.workspaces[key] == h200.workspaces[key]
    assert all(h100.workspaces[k] == v for k, v in own.workspaces.items())
    assert h100.exact and not h100.sibling and h100.nvml == own.nvml
    forward = "gemm_forward"  # the inference floor stage, first run on the H200
    assert forward not in own.floor["lazy"] and h100.floor["lazy"][forward] > 0
    assert h100.floor["lazy"] == {**h200.floor["lazy"], **own.floor["lazy"]}


def test_an_inference_step_reads_the_forward_gemm_stage_of_a_table(tmp_path, monkeypatch):
    """Lazy loading loads only the kernels a process calls: with a harvest's forward-only
    GEMM stage, inference takes it, training the whole GEMM stage; the high end keeps the
    whole stage either way."""
    import json

    import torch

    monkeypatch.setenv(MEASURED_DIR_ENV, str(tmp_path))
    path = _measured_file(tmp_path, ("2.5", "12.4"), 0, 300 * MiB)
    data = json.loads(path.read_text())
    data["floor"]["lazy"].update(gemm=640 * MiB, gemm_forward=560 * MiB, conv=520 * MiB)
    path.write_text(json.dumps(data))
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 30 * 30, 10))
    session = Session(
        model, example_batch=torch.randn(4, 3, 32, 32), gpu="a100-40gb", stack="torch2.5-cu12.4"
    )
    train = session.estimate(batch_size=4)
    infer = session.estimate(batch_size=4, mode="infer")
    assert train.runtime["cublas_kernels"] == 140 * MiB
    assert infer.runtime["cublas_kernels"] == 60 * MiB
    assert infer.runtime["cudnn_kernels"] == train.runtime["cudnn_kernels"] == 20 * MiB
    high_above = infer.peak.device_total_range_bytes[1] - infer.peak.device_total_bytes
    assert high_above >= 80 * MiB  # the whole GEMM stage's 140 MiB at the high end


def test_eager_module_loading_raises_the_floor():
    lazy = _estimate(gpu="a100-40gb", stack="torch2.5-cu12.4")
    eager = _estimate(gpu="a100-40gb", stack="torch1.12-cu11.6")
    assert eager.runtime["cuda_context"] > lazy.runtime["cuda_context"]
    with pytest.raises(Exception, match="not like torch2.14-cu12.8"):
        device_options(stack="2.5")


def test_what_the_harvest_writes_is_what_the_device_model_reads(tmp_path, monkeypatch):
    """The GPU harvest's own assembler and writer, fed a harvest of one convolution with
    benchmark on, produce a file the device model finds for that card and stack: the
    search allocates the first call's workspace, later calls the cached plan's, and the
    staged floor becomes the CUDA context and the kernel images."""
    from benchmarks.gpu_harvest import assemble
    from benchmarks.gpu_harvest.measured_format import write_measured

    case = {
        "pass": "forward", "dtype": "float32", "memory_format": "contiguous",
        "input": list(X), "weight": list(W), "stride": [1, 1], "padding": [1, 1],
        "dilation": [1, 1], "groups": 1, "benchmark": True, "reserved_growth_bytes": 0,
        "oom": None,
    }  # fmt: skip
    harvest = {
        "device": {"name": "NVIDIA A100-SXM4-40GB", "compute_capability": "8.0",
                   "total_memory": 40960 * MiB},
        "stack": {"torch": "2.5.1", "cuda": "12.4", "cudnn": "9.1.0", "driver": "550.54"},
        "nvml_idle": {"v1_used": 430 * MiB, "v2_used": 6 * MiB,
                      "driver_reserved_bytes": 424 * MiB, "v1_total": 40960 * MiB},
        "floor": {"lazy": {"init": {"floor_bytes": 500 * MiB},
                           "gemm": {"floor_bytes": 560 * MiB},
                           "conv": {"floor_bytes": 900 * MiB}}},
        "conv": {"records": [
            {**case, "call": 1, "workspace_bytes": 40 * MiB, "cache_emptied": True},
            {**case, "call": 2, "workspace_bytes": 5 * MiB, "cache_emptied": False},
        ]},
    }  # fmt: skip
    write_measured(assemble.measured_from(harvest), tmp_path)
    monkeypatch.setenv(MEASURED_DIR_ENV, str(tmp_path))
    options = device_options(gpu="a100-40gb", stack="torch2.5-cu12.4")
    assert options.measured is not None
    trace = _conv_trace([("forward", ("forward",)), ("forward", ("forward",))])
    added = _workspace_requests(
        requests_of(device_trace(trace, A100, True, "central", options.measured)), trace
    )
    assert added == [
        ("alloc", (40 * MiB,)),
        ("free", 40 * MiB),
        ("empty_cache", 0),
        ("alloc", 5 * MiB),
        ("free", 5 * MiB),
        ("alloc", 5 * MiB),
        ("free", 5 * MiB),
    ]
    from vramplan.device.runtime import driver_reserved_bytes, outside_allocator

    outside = outside_allocator(
        trace, A100, profile=None, stack=options.software, measured=options.measured
    )
    assert (outside.cuda_context, outside.cudnn_kernels) == (500 * MiB, 400 * MiB)
    assert driver_reserved_bytes(A100, options.measured) == 424 * MiB


def test_the_h200_table_serves_batches_it_did_not_run():
    """The committed H200 harvest ran vgg16's convolutions at batch 32, 64 and 128; batch 96
    is affine between 64 and 128, the measured batches come back exactly, beyond them
    proportional. This layout-transform engine's workspace is affine in the batch, so the
    measured batch 64 lies on the line through 32 and 128."""
    from vramplan.device.cudnn import ConvCase
    from vramplan.device.measured import measured_for

    table = measured_for("H200", "torch2.11-cu13.0")
    assert table is not None and table.nvml["driver_reserved_bytes"] == 644939776

    def case(batch: int) -> ConvCase:
        shape = (batch, 64, 224, 224)
        return ConvCase(
            "forward", "float32", "contiguous", shape, (64, 64, 3, 3), (1, 1), (1, 1), (1, 1), 1
        )

    small, middle, large = (table.workspace(case(n), False) for n in (32, 64, 128))
    assert all(_table_key(case(n)) in table.workspaces for n in (32, 64, 128))
    assert table.workspaces[_table_key(case(32))] == small
    assert middle == tuple(round(a + (b - a) / 3) for a, b in zip(small, large, strict=True))
    assert _table_key(case(96)) not in table.workspaces
    between = table.workspace(case(96), False)
    assert between == tuple(round(a + (b - a) / 2) for a, b in zip(middle, large, strict=True))
    assert table.workspace(case(256), False) == tuple(2 * b for b in large)
    assert table.workspace(case(96), True) is not None  # benchmark-on rows interpolate too


def _table_key(case) -> tuple:
    from vramplan.device.measured import _key

    return _key(case, False)


def test_another_pytorch_on_the_same_card_and_cuda_takes_the_table_as_its_central_reading():
    """The H200 table was measured on torch 2.11 + CUDA 13.0. Torch 2.14 on CUDA 13.0 takes
    its floor and workspaces as the central figure with the model's range around it; CUDA
    12.8 takes nothing from it."""
    import vramplan

    def estimate(stack: str):
        session = vramplan.Session("torchvision:resnet18", gpu="h200", stack=stack)
        return session.estimate(batch_size=8, input_shape=(3, 64, 64), optimizer="sgd")

    own, near, other = (
        estimate(s) for s in ("torch2.11-cu13.0", "torch2.14-cu13.0", "torch2.14-cu12.8")
    )
    assert own.details["measured_table"] == near.details["measured_table"] != ""
    assert other.details["measured_table"] == ""
    assert near.runtime == own.runtime != other.runtime
    assert near.peak.device_total_bytes == own.peak.device_total_bytes
    (own_low, own_high), (near_low, near_high) = (
        own.peak.device_total_range_bytes,
        near.peak.device_total_range_bytes,
    )
    assert near_low < own_low and near_high > own_high
    assert any("same card and CUDA" in note for note in near.notes)


def test_the_h200_table_reproduces_its_fresh_process_rows():
    """A committed GPU measurement as ground truth: ResNet-18 (batch 8, 64x64, SGD) run on
    the H200 in a fresh process, re-estimated on the CPU for that card and stack."""
    from pathlib import Path

    from benchmarks.accuracy.gpu_table import estimate_row, measure_rows, table_identity

    folder = Path(__file__).resolve().parents[1] / "benchmarks/results/gpu-nvidia-h200-2026-11-27"
    gpu, stack = table_identity(folder)
    assert (gpu, stack) == ("H200", "torch2.11-cu13.0")
    row = next(r for r in measure_rows(folder / "rows") if r.name == "resnet18-sgd-fresh")
    result = estimate_row(row, gpu, stack)
    for figure in ("allocated", "reserved", "device_total"):
        assert abs(result[f"error_{figure}"]) < 0.02, (figure, result)
    assert result["inside_device_total"] and result["inside_reserved"]


def test_hopper_central_workspace_is_the_layout_transform_the_h200_measured():
    """Every benchmark-off call the H200 harvest measured, against the Hopper reading: the
    median call asks for its layout-transform copies (input + output + filter), and summed
    over the calls the rule is nearer the measurement than the Winograd reading."""
    import statistics

    from vramplan.device.cudnn import ConvCase, engine_workspace, layout_transform
    from vramplan.device.measured import measured_for

    table = measured_for("H200", "torch2.11-cu13.0")
    ratios, measured, hopper, winograd = [], 0, 0, 0
    for key, (_, cached) in table.workspaces.items():
        if key[-1]:  # benchmark on
            continue
        case = ConvCase(key[0], key[1], key[2], *key[3:9])
        rule = layout_transform(case)
        if rule:
            ratios.append(cached / rule)
        measured += cached
        hopper += engine_workspace(case, family="Hopper").central
        winograd += engine_workspace(case).central
    assert len(ratios) > 500
    assert 0.9 < statistics.median(ratios) < 1.1
    assert abs(hopper - measured) < abs(winograd - measured) / 3


def test_the_h200_benchmark_row_lies_in_the_range_the_segment_placement_spans():
    """VGG16 at batch 128 with ``cudnn.benchmark`` on the H200 (measured reserved 22218
    MiB): whether a kept weight gradient takes a parameter segment's free tail or an
    activation segment's, pinning it through the searches' ``emptyCache()``, depends on
    which lies lower (``BlockComparatorSize``), which the driver decides; the central
    replay puts new segments above the earlier ones, the range's high end below them."""
    from pathlib import Path

    from benchmarks.accuracy.gpu_table import benchmark_rows, estimate_row, table_identity

    folder = Path(__file__).resolve().parents[1] / "benchmarks/results/gpu-nvidia-h200-2026-11-27"
    gpu, stack = table_identity(folder)
    rows = benchmark_rows(folder / "rows" / "cudnn_benchmark_on.jsonl")
    row = next(r for r in rows if r.name == "vgg16-b128-bench")
    result = estimate_row(row, gpu, stack)
    assert abs(result["error_allocated"]) < 0.002, result
    assert result["estimate_reserved"] < row.measured["reserved"]
    assert result["inside_reserved"], result


def test_a_batch_the_harvest_did_not_run_gets_its_neighbours_engines_as_the_range():
    """At batch 64, between a harvest's batch 32 and 128, the central workspace is affine
    between them and the ends are each measured engine's workspace per image; at a batch
    the harvest ran, the measurement is the whole range."""
    from vramplan.device.measured import SCHEMA, parse_table
    from vramplan.device.replay import conv_workspace

    rows = [
        {"pass": "forward", "dtype": "float32", "input": [n, 64, 56, 56], "weight": [64, 64, 3, 3],
         "stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "groups": 1,
         "workspace_bytes": w}
        for n, w in ((32, 96 * MiB), (128, 256 * MiB))
    ]  # fmt: skip
    table = parse_table({"schema": SCHEMA, "gpu": "NVIDIA H200", "conv_workspaces": rows})

    def case(n: int) -> ConvCase:
        return ConvCase("forward", "float32", "contiguous", (n, 64, 56, 56), (64, 64, 3, 3),
                        (1, 1), (1, 1), (1, 1), 1)  # fmt: skip

    between = conv_workspace(case(64), False, table)
    assert (between.low, between.central, between.high) == (
        128 * MiB,
        round(96 * MiB + 160 * MiB / 3),
        192 * MiB,
    )
    ran = conv_workspace(case(128), False, table)
    assert ran.low == ran.central == ran.high == 256 * MiB


def test_benchmark_on_without_a_table_warns_that_the_search_may_read_higher(tmp_path, monkeypatch):
    """With the engine model's candidates the first step's search is a lower bound of what
    cuDNN times; the note says so, and only when some configuration is not measured."""
    monkeypatch.setenv(MEASURED_DIR_ENV, str(tmp_path))
    on = _estimate(gpu="a100-40gb", stack="torch2.5-cu12.4", cudnn_benchmark=True)
    off = _estimate(gpu="a100-40gb", stack="torch2.5-cu12.4")
    assert any(n.startswith("benchmark on: each configuration's first call") for n in on.notes)
    assert not any(n.startswith("benchmark on:") for n in off.notes)


@pytest.mark.parametrize("name", ["lstm-adamw", "gpt2-amp-s256"])
def test_cudnn_rnn_and_cudnn_attention_load_cudnn_kernels_as_the_h200_measured(name):
    """The H200 fresh-process study: the LSTM (cuDNN RNN on CUDA) and a bf16 GPT-2 (SDPA's
    cuDNN attention on sm90) held the harvest's gemm_conv floor, 16 MiB of cuDNN kernels
    above its gemm floor, with no convolution in the step. The floor outside the allocator
    (device total less reserved) is estimated at or just above what was measured."""
    from pathlib import Path

    from benchmarks.accuracy.gpu_table import estimate_row, study_rows, table_identity

    folder = Path(__file__).resolve().parents[1] / "benchmarks/results"
    folder /= "gpu-nvidia-h200-2026-11-27-fresh"
    gpu, stack = table_identity(folder)
    row = next(r for r in study_rows(next((folder / "accuracy").glob("*.csv"))) if r.name == name)
    result = estimate_row(row, gpu, stack)
    measured = result["measured_device_total"] - result["measured_reserved"]
    estimated = result["estimate_device_total"] - result["estimate_reserved"]
    assert measured <= estimated <= measured + 8 * MiB, (measured, estimated)


def test_a_transposed_convolution_asks_for_its_own_output_in_the_layout_copies():
    """A transposed convolution's output grows with the stride: Mask R-CNN's mask head
    (ConvTranspose2d 256 -> 256, 2 x 2, stride 2) over 800 RoIs of 14 x 14 writes 28 x 28
    maps, and on the H200 its cuDNN call asked for 803,864,723 bytes
    (``gpu-nvidia-h200-2026-11-30/snapshots/maskrcnn-infer-b8``): the NCHW <-> NHWC
    copies of its input, that output and the filter, to 147 bytes. Read as a strided
    convolution (7 x 7 outputs), the model had said a quarter of it."""
    from vramplan.device.cudnn import layout_transform

    case = ConvCase("forward", "float32", "contiguous", (800, 256, 14, 14), (256, 256, 2, 2),
                    (2, 2), (0, 0), (1, 1), 1, transposed=True)  # fmt: skip
    assert case.output_spatial == (28, 28)
    copies = (800 * 256 * 14 * 14 + 800 * 256 * 28 * 28 + 256 * 256 * 2 * 2) * 4
    assert layout_transform(case) == copies
    assert 0 <= 803_864_723 - engine_workspace(case, family="Hopper").central < 1024
    narrower = replace(case, weight=(256, 64, 2, 2), output_padding=(1, 1))
    assert narrower.output_channels == 64 and narrower.output_spatial == (29, 29)
