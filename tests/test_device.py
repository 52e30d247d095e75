"""The device model: block sizes, reserved and device totals, runtime terms, verdicts."""

from __future__ import annotations

import json

import pytest

from vramplan.device.catalog import catalog, gpu_from_memory, lookup_gpu
from vramplan.device.table import runtime_table
from vramplan.errors import UserError


@pytest.fixture
def tiny_gpt2(gpt2_config):
    return f"hf:{gpt2_config(vocab_size=1024, n_positions=128, n_embd=64)}"


@pytest.mark.parametrize(
    "spelling,name",
    [
        ("a100", "A100-80GB"),
        ("A100-80GB", "A100-80GB"),
        ("a100_40gb", "A100-40GB"),
        ("h100", "H100-SXM"),
        ("NVIDIA H100 PCIe", "H100-PCIe"),
        ("Tesla T4", "T4"),
        ("rtx 4090", "RTX-4090"),
        ("MI300X", "MI300X"),
    ],
)
def test_gpu_spellings(spelling, name):
    assert lookup_gpu(spelling).name == name


def test_catalog_covers_the_issue_list():
    names = {gpu.name for gpu in catalog()}
    assert {
        "T4",
        "V100-16GB",
        "V100-32GB",
        "A10",
        "A10G",
        "L4",
        "L40S",
        "A100-40GB",
        "A100-80GB",
        "H100-SXM",
        "H100-PCIe",
        "H200",
        "B200",
        "RTX-3090",
        "RTX-4090",
        "RTX-5090",
        "MI250X",
        "MI300X",
    } <= names
    assert all(gpu.total_bytes % 2**20 == 0 for gpu in catalog())
    assert gpu_from_memory("24GiB").total_bytes == 24 * 2**30


def test_unknown_gpu_lists_close_matches():
    with pytest.raises(UserError, match="close matches: .*A100"):
        lookup_gpu("a1000")


def test_figures_are_ordered_and_verdict_follows(run_cli, tiny_gpt2):
    code, out, _ = run_cli(
        "estimate",
        tiny_gpt2,
        "--seq-len",
        "64",
        "--batch-size",
        "2",
        "--precision",
        "amp-bf16",
        "--optimizer",
        "adamw",
        "--gpu",
        "a100-40gb",
        "--json",
    )
    assert code == 0
    data = json.loads(out)
    peak = data["peak"]
    assert peak["allocated_bytes"] <= peak["reserved_bytes"] <= peak["device_total_bytes"]
    assert sum(data["components"].values()) == peak["allocated_bytes"]
    verdict = data["verdict"]
    assert verdict["gpu"] == "A100-40GB" and verdict["capacity_bytes"] == (40960 - 424) * 2**20
    assert verdict["usable_bytes"] == int(verdict["capacity_bytes"] * 0.9)
    assert verdict["status"] == "fits"
    # the verdict reads the high end of the range, less the driver reserve nvml-v1 counts
    low, high = peak["device_total_range_bytes"]
    assert low <= peak["device_total_bytes"] <= high
    assert verdict["compared_bytes"] == high - data["runtime"]["driver_reserved"]
    runtime = data["runtime"]
    assert peak["device_total_bytes"] - peak["reserved_bytes"] == (
        runtime["cuda_context"]
        + runtime["cublas_kernels"]
        + runtime["cudnn_kernels"]
        + runtime["nccl"]
        + runtime["driver_reserved"]
    )
    # one cuBLAS + one cuBLASLt workspace for forward and again for backward (two threads)
    table = runtime_table()
    assert runtime["cublas_workspace"] == 2 * table["cublas_workspace"]["default_bytes"]
    assert runtime["cublaslt_workspace"] == 2 * table["cublaslt_workspace"]["bytes"]


def test_hopper_gets_the_larger_cublas_workspace(run_cli, tiny_gpt2):
    code, out, _ = run_cli("estimate", tiny_gpt2, "--seq-len", "32", "--gpu", "h100", "--json")
    assert json.loads(out)["runtime"]["cublas_workspace"] == 2 * 32 * 2**20


def test_allocated_counts_block_sizes(run_cli, tiny_gpt2):
    _, out, _ = run_cli("estimate", tiny_gpt2, "--seq-len", "32", "--json")
    data = json.loads(out)
    tensor_level = data["details"]["tensor_allocated_bytes"]
    assert data["peak"]["allocated_bytes"] >= tensor_level
    assert all(value % 512 == 0 for value in data["components"].values())  # whole blocks


def test_headroom_moves_fits_to_tight_and_oom_exits_3(run_cli, tiny_gpt2):
    _, out, _ = run_cli("estimate", tiny_gpt2, "--seq-len", "32", "--json")
    data = json.loads(out)
    total = data["peak"]["device_total_range_bytes"][1] - data["runtime"]["driver_reserved"]
    card = f"{int(total / 0.95)}B"  # the high end of the step fills 95% of this card
    code, out, _ = run_cli(
        "estimate",
        tiny_gpt2,
        "--seq-len",
        "32",
        "--gpu-memory",
        card,
        "--headroom",
        "0.0",
        "--json",
    )
    assert code == 0 and json.loads(out)["verdict"]["status"] == "fits"
    code, out, _ = run_cli(
        "estimate",
        tiny_gpt2,
        "--seq-len",
        "32",
        "--gpu-memory",
        card,
        "--headroom",
        "0.1",
        "--json",
    )
    assert code == 0 and json.loads(out)["verdict"]["status"] == "tight"
    code, out, _ = run_cli(
        "estimate", tiny_gpt2, "--seq-len", "32", "--gpu-memory", f"{total // 2}B", "--json"
    )
    assert code == 3 and json.loads(out)["verdict"]["status"] == "oom"


def test_expandable_segments_map_whole_pages(run_cli, tiny_gpt2):
    _, plain, _ = run_cli("estimate", tiny_gpt2, "--seq-len", "64", "--batch-size", "4", "--json")
    _, expandable, _ = run_cli(
        "estimate",
        tiny_gpt2,
        "--seq-len",
        "64",
        "--batch-size",
        "4",
        "--alloc-conf",
        "expandable_segments:True",
        "--json",
    )
    plain, expandable = json.loads(plain)["peak"], json.loads(expandable)["peak"]
    assert expandable["allocated_bytes"] <= expandable["reserved_bytes"]
    assert expandable["reserved_bytes"] % (2 * 2**20) == 0


@pytest.mark.parametrize(
    "args,message",
    [
        (["--gpu", "a1000"], "unknown GPU 'a1000'; close matches"),
        (["--alloc-conf", "max_split_size_mb:abc"], "needs a number"),
        (["--headroom", "1.2"], "headroom must be a fraction"),
        (["--gpu", "t4", "--gpu-memory", "16GiB"], "either --gpu or --gpu-memory"),
        (["--gpu-memory", "lots"], "cannot read GPU memory"),
        (["--framework", "jax"], "unknown framework"),
    ],
)
def test_bad_device_input(run_cli, tiny_gpt2, args, message):
    code, _, err = run_cli("estimate", tiny_gpt2, "--seq-len", "32", *args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err


def test_tensorflow_is_explained(run_cli, tiny_gpt2):
    code, out, _ = run_cli(
        "estimate", tiny_gpt2, "--seq-len", "32", "--framework", "tensorflow", "--json"
    )
    notes = json.loads(out)["notes"]
    assert code == 0 and any("set_memory_growth" in n for n in notes)
    assert any("TensorFlow takes" in n for n in notes)  # the preallocated card, said


def test_gpus_command_json(run_cli):
    code, out, _ = run_cli("gpus", "--json")
    rows = json.loads(out)
    assert code == 0 and {"name", "total_bytes", "arch"} <= set(rows[0])


def test_both_cublas_workspaces_reach_the_allocator_in_each_phase():
    """cuBLAS and cuBLASLt each allocate a workspace at the first matmul of forward and of
    backward; both must be events of the replay (one index holds one event)."""
    import torch
    from torch import nn

    from vramplan.device.replay import device_trace
    from vramplan.device.runtime import cublas_workspace_bytes, cublaslt_workspace_bytes
    from vramplan.recipe import Recipe
    from vramplan.sources.user_code import module_source
    from vramplan.trace.policy import CudaPolicy
    from vramplan.trace.step import trace_training

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    recipe = Recipe(batch_size=4, input_shape=(64,), optimizer="sgd")
    trace = trace_training(module_source(model, recipe, "mlp"), recipe, CudaPolicy())
    gpu = lookup_gpu("h100")
    on_device = device_trace(trace, gpu, cudnn_benchmark=False)
    seen = [
        (e.allocation.op, e.allocation.nbytes, on_device.trace.phase_at(e.index).phase)
        for e in on_device.trace.events()
        if e.is_alloc and e.allocation.op.endswith("_workspace")
    ]
    for phase in ("forward", "backward"):
        assert ("cublas_workspace", cublas_workspace_bytes(gpu), phase) in seen
        assert ("cublaslt_workspace", cublaslt_workspace_bytes(gpu), phase) in seen


def test_a_convolution_backward_runs_each_pass_after_the_gradient_it_writes():
    """PyTorch's cuDNN backward (``cudnn_convolution_backward``) allocates the input's
    gradient and runs the data pass (its workspace allocated and freed), then allocates the
    weight's gradient and runs the filter pass: the order an H200 snapshot of Faster
    R-CNN's training step recorded for every such call. The meta kernel returns both
    gradients at once; the device trace slots each pass's workspace after its own."""
    import torch
    from torch import nn

    from vramplan.device.replay import WORKSPACE, device_trace
    from vramplan.recipe import Recipe
    from vramplan.sources.user_code import module_source
    from vramplan.trace.policy import CudaPolicy
    from vramplan.trace.step import trace_training

    with torch.device("meta"):
        model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Conv2d(16, 16, 3))
    recipe = Recipe(batch_size=4, input_shape=(3, 32, 32), optimizer="sgd")
    trace = trace_training(module_source(model, recipe, "convs"), recipe, CudaPolicy())
    on_device = device_trace(trace, lookup_gpu("h100"), cudnn_benchmark=False)
    backward = [
        (e.allocation.op, e.allocation.nbytes)
        for e in on_device.trace.events()
        if e.is_alloc and e.allocation.phase == "backward" and e.allocation.iteration == 1
    ]
    grad_input, grad_weight = 4 * 16 * 30 * 30 * 4, 16 * 16 * 3 * 3 * 4
    calls = [i for i, (op, _) in enumerate(backward) if op == "convolution_backward"]
    first = calls[0]  # the second convolution's backward: both gradients
    assert backward[first] == ("convolution_backward", grad_input)
    assert backward[first + 1][0] == WORKSPACE  # the data pass
    assert backward[first + 2] == ("convolution_backward", grad_weight)
    assert backward[first + 3][0] == WORKSPACE  # the filter pass


def test_cublas_workspaces_follow_the_first_matmul_output():
    """The workspaces are created by the first cuBLAS call of the phase, after its output
    (``getCurrentCUDABlasHandle`` in the op's kernel), not where the phase begins: ops
    before it (a ReLU here) allocate first."""
    import torch
    from torch import nn

    from vramplan.device.replay import device_trace
    from vramplan.ops import Library, library_of
    from vramplan.recipe import Recipe
    from vramplan.sources.user_code import module_source
    from vramplan.trace.policy import CudaPolicy
    from vramplan.trace.step import trace_training

    with torch.device("meta"):
        model = nn.Sequential(nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    recipe = Recipe(batch_size=4, input_shape=(64,), optimizer="sgd")
    trace = trace_training(module_source(model, recipe, "mlp"), recipe, CudaPolicy())
    on_device = device_trace(trace, lookup_gpu("h100"), cudnn_benchmark=False)
    forward = [
        e.allocation
        for e in on_device.trace.events()
        if e.is_alloc and e.allocation.phase == "forward" and e.allocation.iteration == 1
    ]
    ops = [a.op for a in forward]
    at = ops.index("cublas_workspace")
    assert ops[at + 1] == "cublaslt_workspace"
    assert library_of(ops[at - 1]) is Library.MATMUL  # the first matmul's output
    assert not any(library_of(op) is Library.MATMUL for op in ops[: at - 1])
    assert "relu" in ops[: at - 1]  # the ReLU before it allocated first
