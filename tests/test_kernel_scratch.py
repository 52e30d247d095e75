"""The scratch CUDA kernels take inside an op (``trace/kernel_scratch.py``): the launch
arithmetic of PyTorch's reductions and the fused attention backward kernels against what a
lent H200 allocated in every case the harvest measured, and the recorder placing that
scratch after the op's outputs on the CUDA policy only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks.gpu_harvest.reduce_workspace import CASES as REDUCE_CASES
from vramplan.device.catalog import gpu_from_memory, lookup_gpu
from vramplan.recipe import Recipe
from vramplan.sources.user_code import module_source
from vramplan.trace.kernel_scratch import (
    Card,
    KernelScratch,
    attention_scratch,
    reduction_scratch,
)
from vramplan.trace.policy import CpuPolicy, CudaPolicy
from vramplan.trace.step import trace_training

HARVEST = Path(__file__).parents[1] / "benchmarks/results/gpu-nvidia-h200-2026-11-30"
H200 = Card(multiprocessors=132, threads_per_multiprocessor=2048)
ACCUMULATOR = {"sum": 4, "mean": 4, "norm": 4, "amax": 2, "var_mean": 16}


def _measured(name: str) -> dict:
    data = json.loads((HARVEST / name).read_text())
    versions = data["versions"]
    assert versions["gpu"] == "NVIDIA H200" and versions["torch"].startswith("2.11")
    return data


def _scratch(record: dict, key: str) -> tuple[int, ...]:
    return tuple(r["size"] for r in record[key] if not r["kept"])


def test_every_measured_reduction_is_the_launch_arithmetic():
    data = _measured("reduce_workspace.json")
    assert data["versions"]["multiprocessors"] == H200.multiprocessors
    checked = 0
    for case, record in zip(REDUCE_CASES, data["records"], strict=True):
        assert record["case"] == case.name
        if case.op.endswith("_backward"):
            continue
        x = torch.empty(case.shape, dtype=getattr(torch, case.dtype), device="meta")
        if case.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        accumulator = 2 if case.op == "amax" and case.dtype != "float32" else ACCUMULATOR[case.op]
        got = reduction_scratch(tuple(x.shape), x.stride(), 0, case.dims, accumulator, H200)
        assert got == _scratch(record, "requests"), case.name
        checked += 1
    assert checked == 22


def test_a_card_with_fewer_multiprocessors_splits_a_long_sum_less():
    shape, strides = (32768, 4096), (4096, 1)
    on_h200 = reduction_scratch(shape, strides, 0, (0,), 4, H200)
    on_l4 = reduction_scratch(shape, strides, 0, (0,), 4, lookup_gpu("l4").kernel_card)
    assert on_h200 == (138412032, 128)  # 66 blocks per output column: 2112 / 32 columns
    # 58 SMs x 12 blocks: 696 / 32 columns -> 22, raised to 8192 values / 256 = 32 per thread
    assert on_l4 == (4 * 4096 * 32 * 32 * 4, 128)


@pytest.mark.parametrize("backend", ["cudnn", "flash", "efficient"])
def test_every_measured_attention_backward_is_the_kernels_scratch(backend):
    records = [
        r
        for r in _measured("sdpa_workspace.json")["records"]
        if r["backend"] == backend
        and "error" not in r
        and (r["layout"] == "bshd" or backend == "cudnn")
    ]
    assert len(records) >= 4
    for r in records:
        q = (r["batch"], r["heads"], r["seq"], r["head_dim"])
        kv = (r["batch"], r["kv_heads"], r["seq"], r["head_dim"])
        assert attention_scratch(backend, q, kv, kv, 2) == _scratch(r, "backward"), r["case"]


def test_kernel_cards_by_architecture():
    assert lookup_gpu("h200").kernel_card == H200
    assert lookup_gpu("t4").kernel_card.threads_per_multiprocessor == 1024
    assert lookup_gpu("rtx4090").kernel_card.threads_per_multiprocessor == 1536
    assert lookup_gpu("mi300x").kernel_card == Card(304, 2048, rocm=True)
    assert gpu_from_memory("24GiB").kernel_card.multiprocessors == 108  # an sm80 by default


class _Biased(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(512, 896)
        self.head = nn.Linear(896, 8, bias=False)

    def forward(self, x):
        return self.head(self.proj(x))


def _scratch_records(policy) -> list:
    recipe = Recipe(batch_size=8192, input_shape=(512,), optimizer="sgd")
    built = module_source(_Biased(), recipe, "biased")
    trace = trace_training(built, recipe, policy)
    return [a for a in trace.allocations if a.op.endswith(":scratch")]


def test_a_bias_gradient_takes_the_reductions_staging_on_cuda_only():
    card = lookup_gpu("h200").kernel_card
    records = _scratch_records(CudaPolicy("sm90", card=card))
    staging = reduction_scratch((8192, 896), (896, 1), 0, (0,), 4, card)
    per_backward = [a.nbytes for a in records if a.iteration == 1]
    assert per_backward == list(staging)  # the bias's sum over 8192 rows, nothing else
    for a in records:
        assert a.op == "sum:scratch" and a.free_index is not None
        assert a.free_index - a.alloc_index < 2 * len(staging)  # freed before the next op
    assert _scratch_records(CpuPolicy()) == []


def test_the_scratch_sizer_reads_dims_from_the_schema():
    x = torch.empty(8, 1024, 896, dtype=torch.bfloat16, device="meta")
    sizer = KernelScratch(H200)
    by_dims = sizer.sizes("sum", torch.ops.aten.sum.dim_IntList, (x, [0, 1]), {})
    assert by_dims == reduction_scratch((8192, 896), (896, 1), 0, (0,), 4, H200)
    everything = sizer.sizes("sum", torch.ops.aten.sum.default, (x,), {})
    assert everything == (2112, 4)  # 528 blocks of one output: block-x reduced, no widths
    assert sizer.sizes("add", torch.ops.aten.add.Tensor, (x, x), {}) == ()


def test_topk_copies_a_strided_input_first():
    """``launch_gather_topk_kernel`` begins with ``self.contiguous()``: a slice of the RPN's
    objectness (one pyramid level of every image) costs a dense copy for the call, the
    1.54 MiB request the H200 made at ``rpn.py:237`` in Faster R-CNN's step (2 images x
    201,600 anchors of fp32); a contiguous input costs none."""
    objectness = torch.empty(2, 242991, device="meta")
    level = objectness.split([201600, 41391], dim=1)[0]
    sizer = KernelScratch(H200)
    assert sizer.sizes("topk", torch.ops.aten.topk.default, (level, 2000, 1), {}) == (
        2 * 201600 * 4,
    )
    dense = level.contiguous()
    assert sizer.sizes("topk", torch.ops.aten.topk.default, (dense, 2000, 1), {}) == ()
