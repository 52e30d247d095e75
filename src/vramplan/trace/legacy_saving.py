"""What autograd kept for a multiplication or a division before PyTorch 1.1.

Autograd's code generation saves an operand only when a gradient that needs it will be
computed: ``x * scale`` with only ``x`` requiring a gradient keeps ``scale`` (small) and
lets ``x`` go. The codegen has guarded such saves by ``should_compute_output`` since
pytorch/pytorch PR #16583 (January 2019, so PyTorch 1.1; it names ``mul`` and ``div``
among the operators it changes; PR #46296 quotes the guarded ``mul_`` code of late 2020).
Before, ``mul`` and ``div`` kept every operand their derivative formulas name whenever
any input required a gradient, and a FrozenBatchNorm2d (``x * scale + bias``) kept its
full-size input ``x`` as well. (PR #45777, PyTorch 1.8, extended the guards to
``mm``/``addmm``, whose formulas named ``mat1`` in its own gradient; not modelled.)

While tracing for such a stack, ``saving_every_operand`` routes an out-of-place ``mul``
or ``div`` of two tensors, exactly one of which requires a gradient, through a function
that saves both and computes only the gradient asked for (replacing ``torch.mul``,
``torch.div`` and their ``torch.Tensor`` spellings for the block, ``patching.py``):

>>> x = torch.ones(2, 3, requires_grad=True)
>>> scale = torch.full((1, 3), 2.0)
>>> saved = []
>>> with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
...     with saving_every_operand():
...         y = x * scale
>>> len(saved), y.sum().backward(), x.grad.tolist()
(2, None, [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]])
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vramplan.trace.patching import patched

_MUL = (
    (torch, "mul"),
    (torch.Tensor, "mul"),
    (torch.Tensor, "__mul__"),
    (torch.Tensor, "__rmul__"),
)
_DIV = (
    (torch, "div"),
    (torch, "true_divide"),
    (torch.Tensor, "div"),
    (torch.Tensor, "true_divide"),
    (torch.Tensor, "__truediv__"),
)
_ORIGINALS = {place: getattr(*place) for place in _MUL + _DIV}
_TORCH_MUL, _TORCH_DIV = torch.mul, torch.div


def _reduced(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``grad`` summed down to ``like``'s shape (undoing broadcasting)."""
    return grad.sum_to_size(like.shape) if grad.shape != like.shape else grad


class _MulSavingBoth(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return _TORCH_MUL(a, b)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad_a = _reduced(grad * b, a) if ctx.needs_input_grad[0] else None
        grad_b = _reduced(grad * a, b) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


class _DivSavingBoth(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return _TORCH_DIV(a, b)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad_a = _reduced(grad / b, a) if ctx.needs_input_grad[0] else None
        grad_b = _reduced(-grad * a / (b * b), b) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


def _one_requires_grad(args: tuple, kwargs: dict | None) -> bool:
    if kwargs or len(args) != 2 or not torch.is_grad_enabled():
        return False
    a, b = args
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if not (a.is_floating_point() and b.is_floating_point()):
        return False
    return a.requires_grad != b.requires_grad


def _saving_both(original: Callable, function: type[torch.autograd.Function]) -> Callable:
    def run(*args, **kwargs):
        if _one_requires_grad(args, kwargs):
            return function.apply(*args)
        return original(*args, **kwargs)

    return run


def saving_every_operand():
    """Trace ``mul``/``div`` as autograd before PyTorch 1.1 saved them (module docstring)."""
    return patched(
        (*place, _saving_both(original, _MulSavingBoth if place in _MUL else _DivSavingBoth))
        for place, original in _ORIGINALS.items()
    )
