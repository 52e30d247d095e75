"""What autograd kept for a softmax before PyTorch 1.11: its input as well as its output.

Until pytorch/pytorch PR #65242 (issue #64000; issue #49600 shows the generated
``grad_fn->self_ = SavedVariable(self, false)``), the backward formulas of ``_softmax`` and
``_log_softmax`` named ``self`` (``_softmax_backward_data(grad, result, dim, self)``), so
the input stayed alive until backward though only its dtype is used. PyTorch 1.11 passes
the dtype instead; transformers' ``pytorch_utils.softmax_backward_data`` switches on
``is_torch_less_than_1_11`` for exactly this signature change.

The input kept is the one the call received: on CUDA an fp16 input with ``dtype=float32``
(autocast's softmax) ran ``_softmax(input, dim, half_to_float=True)`` and kept the fp16
input, not an fp32 copy. ``cross_entropy`` is ``log_softmax`` then ``nll_loss`` inside
ATen, so it kept its logits too. While tracing for such a stack, ``keeping_softmax_input``
routes softmax and log_softmax of an input that requires a gradient (and cross_entropy's,
for class-index targets without smoothing) through a function that runs the call and saves
both:

>>> x = torch.randn(2, 3, requires_grad=True)
>>> saved = []
>>> with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
...     with keeping_softmax_input():
...         y = torch.softmax(x, -1)
>>> [t.shape for t in saved], y.sum().backward(), x.grad.abs().max().item() < 1e-6
([torch.Size([2, 3]), torch.Size([2, 3])], None, True)
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from vramplan.trace.patching import patched

aten = torch.ops.aten


class _KeepingInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, log, run):
        out = run(x)
        ctx.dim, ctx.log = dim, log
        ctx.save_for_backward(x, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, out = ctx.saved_tensors
        formula = aten._log_softmax_backward_data if ctx.log else aten._softmax_backward_data
        grad_input = formula(grad, out, ctx.dim, out.dtype)
        return grad_input.to(x.dtype), None, None, None


def _keeping(original, log: bool):
    def call(*args, **kwargs):
        x = args[0] if args else kwargs.get("input")
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if (
            isinstance(dim, int)
            and isinstance(x, torch.Tensor)
            and x.requires_grad
            and torch.is_grad_enabled()
        ):
            rest = {k: v for k, v in kwargs.items() if k != "input"}
            run = lambda t: original(t, *args[1:], **rest)  # noqa: E731
            return _KeepingInput.apply(x, dim, log, run)
        return original(*args, **kwargs)

    return call


def _composed_cross_entropy(original):
    """``cross_entropy`` as ATen composes it (``log_softmax`` over the class dimension, then
    ``nll_loss``), so the patched ``log_softmax`` keeps the logits; soft targets and label
    smoothing run ``original``."""

    def cross_entropy(
        input,
        target,
        weight=None,
        size_average=None,
        ignore_index=-100,
        reduce=None,
        reduction="mean",
        label_smoothing=0.0,
    ):
        if label_smoothing or target.is_floating_point():
            return original(
                input,
                target,
                weight,
                size_average,
                ignore_index,
                reduce,
                reduction,
                label_smoothing,
            )
        log_probs = torch.log_softmax(input, 1 if input.dim() > 1 else 0)
        return F.nll_loss(log_probs, target, weight, size_average, ignore_index, reduce, reduction)

    return cross_entropy


def keeping_softmax_input() -> contextlib.AbstractContextManager:
    """Trace softmax/log_softmax as autograd before PyTorch 1.11 saved them (module
    docstring): ``torch.softmax``, ``torch.log_softmax`` and the ``Tensor`` methods
    ``F.softmax`` and ``F.log_softmax`` call are replaced for the block (``patching.py``:
    a ``TorchFunctionMode`` steps aside while it handles ``backward()``, where a
    checkpoint recomputes its forward)."""
    softmaxes = [
        (owner, name, _keeping(getattr(owner, name), name == "log_softmax"))
        for owner in (torch, torch.Tensor)
        for name in ("softmax", "log_softmax")
    ]
    return patched([*softmaxes, (F, "cross_entropy", _composed_cross_entropy(F.cross_entropy))])
