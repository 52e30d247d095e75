"""Dropout as CUDA keeps it: the fused kernel's 1-byte mask, not the CPU path's noise of
the input's dtype (``trace/cuda_dropout.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vramplan.device.options import device_options
from vramplan.pipeline import trace_and_estimate
from vramplan.recipe import Recipe
from vramplan.sources.user_code import module_source
from vramplan.trace.cuda_dropout import cuda_dropout

BATCH, HIDDEN = 64, 512


def _saved_by(fn, x):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn(x).sum().backward()
    return saved


def test_native_dropout_keeps_only_a_bool_mask_on_a_real_cpu_run():
    """The ground truth the rule stands on: ``native_dropout`` (the kernel CUDA's
    ``at::dropout`` takes) saves one bool mask; the CPU's ``F.dropout`` saves its noise
    at the input's dtype."""
    x = torch.randn(BATCH, HIDDEN, requires_grad=True)
    fused = _saved_by(lambda t: torch.native_dropout(t, 0.1, True)[0], x)
    assert [(t.dtype, t.numel()) for t in fused] == [(torch.bool, x.numel())]
    cpu = _saved_by(lambda t: F.dropout(t, 0.1, training=True), x)
    assert [(t.dtype, t.numel()) for t in cpu] == [(torch.float32, x.numel())]
    with cuda_dropout():
        routed = _saved_by(lambda t: F.dropout(t, 0.1, training=True), x)
        in_place = _saved_by(lambda t: F.dropout(t * 1, 0.1, training=True, inplace=True), x)
        evaluating = _saved_by(lambda t: F.dropout(t, 0.1, training=False), x)
    assert [(t.dtype, t.numel()) for t in routed] == [(torch.bool, x.numel())]
    assert all(t.dtype == torch.float32 for t in in_place) and in_place  # unfused on CUDA too
    assert evaluating == []


def _dropout_step(target: str):
    recipe = Recipe(batch_size=BATCH, optimizer="sgd", input_shape=(HIDDEN,))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Dropout(0.1), nn.Linear(HIDDEN, 10))
    options = device_options(gpu="a100-40gb") if target == "cuda" else None
    return trace_and_estimate(module_source(model, recipe, "m"), recipe, target, options)[1]


def _kept_through_backward(trace, module: str) -> list[int]:
    """Sizes of the dropout module's second-iteration allocations that live into backward."""
    backward = min(m.index for m in trace.phases if m.iteration == 2 and m.phase == "backward")
    return sorted(
        a.nbytes
        for a in trace.allocations
        if a.iteration == 2
        and a.module == module
        and a.phase == "forward"
        and (a.free_index is None or a.free_index > backward)
    )


def test_the_traced_gpu_step_keeps_a_one_byte_mask_and_the_cpu_step_its_noise():
    elements = BATCH * HIDDEN
    assert _kept_through_backward(_dropout_step("cuda"), "1") == [elements, 4 * elements]
    assert _kept_through_backward(_dropout_step("cpu"), "1") == [4 * elements, 4 * elements]
