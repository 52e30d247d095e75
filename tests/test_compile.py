"""torch.compile as traced (``trace/compiled.py``). Ground truth: Inductor itself compiling
on the CPU, and PyTorch's profiler reading the bytes a compiled block keeps for backward."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import TINY_LLAMA
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from vramplan import Recipe
from vramplan.configs.training_args import read_training_args
from vramplan.measurement.run import cpu_peak_of
from vramplan.pipeline import trace_and_estimate
from vramplan.result import Component
from vramplan.sources import resolve
from vramplan.trace.compiled import CompiledRegion
from vramplan.trace.loop import ITERATIONS
from vramplan.trace.materialize import materialize
from vramplan.trace.recorder import AllocationRecorder

SHAPE = (4, 64, 64)


class SwiGluBlock(nn.Module):
    """RMSNorm computed in fp32 and a SwiGLU MLP with a residual: the pointwise chains
    (upcast, rsqrt, SiLU, product) that eager autograd saves and compile recomputes."""

    def __init__(self, dim: int = 64, hidden: int = 128) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.weight
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


def forward_bytes(fn, x: torch.Tensor) -> tuple[int, int]:
    """Bytes a forward leaves alive (its output and what it saved for backward) and its
    peak, read by the profiler; a first call compiles or captures outside the measurement."""
    fn(x)
    held = []
    peak, series = cpu_peak_of(lambda: held.append(fn(x)))
    return series[-1][1], peak


@pytest.fixture(scope="module")
def real_block() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return SwiGluBlock().to(torch.bfloat16), torch.randn(
        SHAPE, dtype=torch.bfloat16
    ).requires_grad_()


@pytest.fixture(scope="module")
def inductor(real_block) -> tuple[int, int]:
    """What Inductor's compiled block keeps, and its forward's peak (skipped where
    Inductor cannot build C++)."""
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler: Inductor cannot compile for the CPU here")
    block, x = real_block
    try:
        return forward_bytes(torch.compile(block), x)
    except Exception as exc:  # Inductor's toolchain missing or broken on this machine
        pytest.skip(f"Inductor cannot compile here: {type(exc).__name__}")


def test_compiled_region_keeps_what_inductor_keeps(real_block, inductor):
    """The min-cut partition run op by op keeps exactly the bytes Inductor's compiled block
    keeps, and fewer than eager autograd (which saves the fp32 RMSNorm and SiLU inputs)."""
    block, x = real_block
    region, _ = forward_bytes(CompiledRegion(block.forward, block), x)
    eager, _ = forward_bytes(block, x)
    assert region == inductor[0], (region, inductor)
    assert region < eager, (region, eager)


def _peak(records) -> int:
    events = sorted(
        [(r.alloc_index, r.nbytes) for r in records]
        + [(r.free_index, -r.nbytes) for r in records if r.free_index is not None]
    )
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def test_traced_region_keeps_what_inductor_keeps(inductor):
    """The same under the tracer: a meta-built block on fake tensors, the recorder counting
    the storages its forward leaves alive (the capture itself recorded nothing). The
    fused pointwise results are not recorded, so the traced forward's peak is below the
    eager block's. (Inductor's own CPU forward peak is not compared: whether its GEMMs add
    packing buffers depends on the CPU's instruction set, and without them it lies 32 KiB
    under the traced peak.)"""
    with torch.device("meta"):
        block = SwiGluBlock().to(torch.bfloat16)
    with FakeTensorMode(), AllocationRecorder() as recorder:
        materialize(block)
        x = torch.empty(SHAPE, dtype=torch.bfloat16, requires_grad=True)
        first = len(recorder.records)
        out = CompiledRegion(block.forward, block)(x)
        compiled = recorder.records[first:]
        kept = sum(r.nbytes for r in compiled if r.free_index is None)
        first = len(recorder.records)
        eager_out = block(x)
        eager = recorder.records[first:]
        del out, eager_out
    assert kept == inductor[0], (kept, inductor)
    assert kept <= _peak(compiled) < _peak(eager), (_peak(compiled), _peak(eager))


def _activations(trace) -> list[int]:
    return [a.nbytes for a in trace.allocations if a.category == Component.ACTIVATIONS]


def test_compiled_llama_saves_less_and_checkpointing_still_wraps_it(tiny_llama):
    """Compiled, a tiny Llama keeps fewer activation bytes; no fp32 logits chunk is kept
    for the chunked loss's backward (the compiled cross-entropy recomputes its upcast);
    checkpointing still recomputes the compiled layers (it wraps them, as torchtune's
    checkpoint_wrapper wraps a compiled layer) and keeps less again."""
    batch, seq, chunks = 2, 64, 4
    fp32_chunk = batch * seq // chunks * TINY_LLAMA["vocab_size"] * 4

    def traced(**knobs):
        recipe = Recipe(
            batch_size=batch, seq_len=seq, precision="bf16", loss_chunks=chunks, **knobs
        )
        return trace_and_estimate(resolve(tiny_llama, recipe), recipe, "cpu")[1]

    eager, compiled = traced(), traced(compile=True)
    checkpointed = traced(compile=True, checkpointing="full")
    assert _activations(eager).count(fp32_chunk) == ITERATIONS * chunks
    assert fp32_chunk not in _activations(compiled)
    assert sum(_activations(compiled)) < sum(_activations(eager))
    assert sum(_activations(checkpointed)) < sum(_activations(compiled))


def test_compile_is_absent_from_an_eager_recipe():
    assert "compile" not in Recipe(batch_size=1).to_json()
    assert Recipe(batch_size=1, compile=True).to_json()["compile"] is True


def test_compile_flag_on_the_command_line(run_cli, tiny_llama):
    """``--compile`` reaches the traced step (its note), and autocast with it is one clear
    line and exit 2 (the captured graph would miss autocast's casts)."""
    code, out, _ = run_cli(
        "estimate", tiny_llama, "--seq-len", "32", "--precision", "bf16", "--compile", "--json"
    )
    assert code == 0 and "torch.compile: 2 repeated blocks" in out
    code, _, err = run_cli("estimate", tiny_llama, "--precision", "amp-bf16", "--compile")
    assert code == 2 and "--compile under autocast" in err and len(err.strip().splitlines()) == 1


def test_trainer_torch_compile_is_honoured_without_autocast():
    """TrainingArguments' ``torch_compile`` sets ``--compile`` in pure precision; under the
    Trainer's autocast (bf16=True) it is noted as not modelled."""
    pure = read_training_args({"torch_compile": True, "per_device_train_batch_size": 2})
    assert pure.options["compile"] is True and pure.recipe().compile
    amp = read_training_args({"torch_compile": True, "bf16": True})
    assert "compile" not in amp.options
    assert any(n.startswith("torch_compile:") for n in amp.notes)
