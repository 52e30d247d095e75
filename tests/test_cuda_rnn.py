"""LSTMs as CUDA keeps them: the native CUDA algorithm's per-step gate state, checked
against nn.LSTM's own shapes and exact arithmetic on the saved workspaces."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from vramplan.recipe import Recipe, parse_shape
from vramplan.sources import resolve
from vramplan.trace.cuda_rnn import cuda_lstm
from vramplan.trace.policy import CpuPolicy, CudaPolicy
from vramplan.trace.step import trace_training
from vramplan.trace.summary import summarize_trace


@pytest.mark.parametrize(
    "bidirectional,batch_first,bias", [(False, True, True), (True, False, False)]
)
def test_native_lstm_matches_nn_lstm_shapes_and_gradients(bidirectional, batch_first, bias):
    with FakeTensorMode():
        lstm = nn.LSTM(
            16,
            32,
            num_layers=2,
            bidirectional=bidirectional,
            batch_first=batch_first,
            bias=bias,
            dropout=0.1,
        )
        x = torch.randn(4, 10, 16) if batch_first else torch.randn(10, 4, 16)
        expected = [t.shape for t in (lambda o: (o[0], *o[1]))(lstm(x))]
        calls: dict[str, int] = {}
        with cuda_lstm(calls):
            out, (h, c) = lstm(x)
        assert [out.shape, h.shape, c.shape] == expected and calls == {"lstm": 1}
        (out.sum() + h.sum() + c.sum()).backward()
        assert all(p.grad is not None and p.grad.shape == p.shape for p in lstm.parameters())


@pytest.mark.filterwarnings("ignore:LSTM with projections")
def test_projections_run_as_before():
    with FakeTensorMode():
        calls: dict[str, int] = {}
        with cuda_lstm(calls):
            out, _ = nn.LSTM(8, 16, proj_size=4)(torch.randn(5, 2, 8))
        assert calls == {} and out.shape == (5, 2, 4)


def test_cuda_trace_keeps_every_steps_gate_workspace():
    recipe = Recipe(batch_size=16, input_shape=parse_shape("64x128"), optimizer="adamw")
    spec = "benchmarks/accuracy/models.py:lstm"  # 2 layers, hidden 256, 64 steps

    def forward(policy):
        trace = trace_training(resolve(spec, recipe), recipe, policy)
        return summarize_trace(trace).phase_components["forward"]["activations"], trace

    cuda, trace = forward(CudaPolicy("sm80"))
    cpu, _ = forward(CpuPolicy())
    layers, steps, batch, hidden = 2, 64, 16, 256
    workspaces = layers * steps * batch * 4 * hidden * 4  # fp32 (batch, 4 hidden) per step
    cell_states = layers * steps * batch * hidden * 4
    assert cuda >= workspaces + cell_states > cpu
    assert trace.op_counts[("forward", "_thnn_fused_lstm_cell")] == 2 * layers * steps
    assert any("native CUDA LSTM" in note for note in trace.notes)
