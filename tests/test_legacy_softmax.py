"""Softmax before PyTorch 1.11 kept its input for backward (``trace/legacy_softmax.py``),
the input it received: under fp16 autocast the fp16 scores, not an fp32 copy."""

from __future__ import annotations

import torch
from torch import nn

from vramplan.device.options import device_options
from vramplan.pipeline import trace_and_estimate
from vramplan.recipe import Recipe
from vramplan.sources.user_code import module_source
from vramplan.trace.legacy_softmax import keeping_softmax_input

BATCH, HIDDEN = 64, 256


def test_the_saved_tensors_are_the_input_and_the_output_and_the_gradient_is_unchanged():
    x = torch.randn(BATCH, HIDDEN, requires_grad=True)
    weights = torch.randn(BATCH, HIDDEN)
    expected = torch.autograd.grad((torch.softmax(x, -1) * weights).sum(), x)[0]
    saved = []
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t)
    with hooks, keeping_softmax_input():
        y = nn.functional.softmax(x, dim=-1)
        logs = x.log_softmax(-1)
    assert saved[0] is x and torch.equal(saved[1], y)
    assert saved[2] is x and torch.equal(saved[3], logs)
    got = torch.autograd.grad((y * weights).sum(), x)[0]
    torch.testing.assert_close(got, expected)


def _kept_from_the_linear(stack: str) -> list[int]:
    """Bytes the first Linear's output (the softmax input) keeps into backward, under
    fp16 autocast on ``stack``."""
    recipe = Recipe(batch_size=BATCH, optimizer="sgd", input_shape=(HIDDEN,), precision="amp-fp16")
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Softmax(dim=-1), nn.Linear(HIDDEN, 4))
    options = device_options(gpu="v100-16gb", stack=stack)
    trace = trace_and_estimate(module_source(model, recipe, "m"), recipe, "cuda", options)[1]
    backward = min(m.index for m in trace.phases if m.iteration == 2 and m.phase == "backward")
    return [
        a.nbytes
        for a in trace.allocations
        if a.iteration == 2
        and a.module == "0"
        and a.op == "addmm"
        and (a.free_index is None or a.free_index > backward)
    ]


def test_a_pre_1_11_stack_keeps_the_fp16_softmax_input_and_a_later_one_does_not():
    assert _kept_from_the_linear("torch1.10-cu11.2") == [BATCH * HIDDEN * 2]
    assert _kept_from_the_linear("torch1.11-cu11.3") == []


def _appending(saved: list):
    def pack(tensor):
        saved.append(tensor)
        return tensor

    return pack


def _same(tensor):
    return tensor


def test_cross_entropy_keeps_its_logits_and_its_loss_and_gradient_are_unchanged():
    """ATen's cross_entropy is log_softmax then nll_loss: before 1.11 the logits stayed."""
    torch.manual_seed(0)
    logits = torch.randn(BATCH, HIDDEN, requires_grad=True)
    target = torch.randint(0, HIDDEN, (BATCH,))
    target[0] = -100  # ignored
    class_weights = torch.linspace(0.5, 1.5, HIDDEN)
    for kwargs in ({}, {"weight": class_weights, "reduction": "sum"}):
        expected_loss = nn.functional.cross_entropy(logits, target, **kwargs)
        expected = torch.autograd.grad(expected_loss, logits)[0]
        saved: list[torch.Tensor] = []
        hooks = torch.autograd.graph.saved_tensors_hooks(_appending(saved), _same)
        with hooks, keeping_softmax_input():
            loss = nn.functional.cross_entropy(logits, target, **kwargs)
        assert any(t is logits for t in saved)
        torch.testing.assert_close(loss, expected_loss)
        torch.testing.assert_close(torch.autograd.grad(loss, logits)[0], expected)


def test_label_smoothing_runs_pytorchs_own_cross_entropy():
    logits = torch.randn(BATCH, HIDDEN, requires_grad=True)
    target = torch.randint(0, HIDDEN, (BATCH,))
    saved = []
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t)
    with hooks, keeping_softmax_input():
        loss = nn.functional.cross_entropy(logits, target, label_smoothing=0.1)
    assert not any(t is logits for t in saved)
    torch.testing.assert_close(
        loss, nn.functional.cross_entropy(logits, target, label_smoothing=0.1)
    )
