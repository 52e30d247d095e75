"""Autograd's saving rule before PyTorch 1.1 (``--stack torch1.0-cu10.0`` and older):
``mul``/``div`` keep both operands when one requires a gradient. From 1.1 (PR #16583)
the generated code guards those saves, as today's does.

Ground truth: PyTorch's own ``saved_tensors_hooks`` on real CPU runs, and the bytes of
the tensors the old rule adds (exact arithmetic).
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn
from torchvision.ops import FrozenBatchNorm2d

from vramplan.device.options import device_options
from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe
from vramplan.result import Component
from vramplan.sources.base import image_classifier
from vramplan.trace.legacy_saving import saving_every_operand

BATCH, CHANNELS, SIDE = 2, 8, 16


def frozen_bn_net() -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, CHANNELS, 3, padding=1),
        FrozenBatchNorm2d(CHANNELS),
        nn.ReLU(),
        nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1),
        FrozenBatchNorm2d(CHANNELS),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(CHANNELS, 10),
    )
    for bn in (net[1], net[4]):
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 2.0)
    return net


def saved_bytes_and_grads(legacy: bool) -> tuple[int, list[torch.Tensor]]:
    net = frozen_bn_net()
    x = torch.randn(BATCH, 3, SIDE, SIDE)
    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if legacy:
            with saving_every_operand():
                out = net(x)
        else:
            out = net(x)
    (out * out).sum().backward()
    return sum(storages.values()), [p.grad for p in net.parameters() if p.grad is not None]


def test_frozen_batch_norm_keeps_its_input_under_the_old_rule_and_gradients_agree():
    today, grads_today = saved_bytes_and_grads(legacy=False)
    legacy, grads_legacy = saved_bytes_and_grads(legacy=True)
    conv_output = BATCH * CHANNELS * SIDE * SIDE * 4
    assert legacy - today == 2 * conv_output  # each FrozenBatchNorm2d's input, once more
    assert len(grads_today) == len(grads_legacy) == 6
    for a, b in zip(grads_today, grads_legacy, strict=True):
        torch.testing.assert_close(a, b)


def test_division_by_a_constant_keeps_the_numerator_and_its_gradient_is_unchanged():
    x = torch.randn(4, 5, requires_grad=True)
    divisor = torch.rand(1, 5) + 1.0
    saved = []
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t)
    with hooks, saving_every_operand():
        (x / divisor).pow(2).sum().backward()
    assert any(t is x for t in saved)
    torch.testing.assert_close(x.grad, 2 * x.detach() / divisor**2)


def test_a_both_operand_multiplication_is_left_to_autograd():
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    with saving_every_operand():
        product = a * b
    assert type(product.grad_fn).__name__ == "MulBackward0"


class BiasThenFrozenNorms(nn.Module):
    """A learnt per-pixel bias, then two FrozenBatchNorm2d + ReLU: no convolution or matmul,
    so no cuDNN or cuBLAS workspace hides the saved tensors at the forward peak."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(1, CHANNELS, SIDE, SIDE))
        self.body = nn.Sequential(
            FrozenBatchNorm2d(CHANNELS),
            nn.ReLU(),
            FrozenBatchNorm2d(CHANNELS),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),  # the pooled channels are the logits: no matmul, no cuBLAS
        )

    def forward(self, x):
        return self.body(x + self.bias)


def test_only_a_stack_before_1_1_traces_the_frozen_batch_norm_inputs():
    recipe = Recipe(batch_size=BATCH, input_shape=(CHANNELS, SIDE, SIDE), optimizer="sgd")
    estimates = {}
    for stack in ("torch1.0-cu10.0", "torch1.1-cu10.0", "torch1.7-cu10.2", "torch2.4-cu12.4"):
        model = BiasThenFrozenNorms()
        built = image_classifier("net", "BiasThenFrozenNorms", model, (CHANNELS, SIDE, SIDE))
        options = device_options(gpu="v100-32gb", stack=stack)
        estimates[stack] = estimate_built(built, recipe, "cuda", options)
    rule = "before PyTorch 1.1: mul/div"
    assert any(rule in note for note in estimates["torch1.0-cu10.0"].notes)
    for stack in ("torch1.1-cu10.0", "torch1.7-cu10.2", "torch2.4-cu12.4"):
        assert not any(rule in note for note in estimates[stack].notes)
    # the first norm's input (x + bias) is kept only by the old rule; the second norm's
    # input is the ReLU's output, which ReLU keeps under either rule
    feature_map = BATCH * CHANNELS * SIDE * SIDE * 4
    kept = Component.ACTIVATIONS
    activations = {stack: e.components[kept] for stack, e in estimates.items()}
    assert activations["torch1.0-cu10.0"] - activations["torch2.4-cu12.4"] == feature_map
    assert activations["torch1.1-cu10.0"] == activations["torch1.7-cu10.2"]
    assert activations["torch1.7-cu10.2"] == activations["torch2.4-cu12.4"]


def test_a_checkpointed_block_recomputes_under_the_old_rule():
    """Non-reentrant checkpointing checks that the recomputation saves what the forward
    saved: the rule must hold in backward too (it crashed when it was a function mode)."""
    x = torch.randn(4, 5, requires_grad=True)
    scale = torch.rand(1, 5) + 1.0
    layer = nn.Linear(5, 5)

    def block(t):
        return layer(t) * scale

    with saving_every_operand():
        torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).sum().backward()
    grad_old = x.grad.clone()
    x.grad = None
    block(x).sum().backward()
    torch.testing.assert_close(grad_old, x.grad)
