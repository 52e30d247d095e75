"""RetinaNet's classification loss as one fused kernel (``--focal-loss fused``).

torchvision's ``sigmoid_focal_loss`` runs op by op (sigmoid, binary cross-entropy, the
modulating factor, the alpha weight) on a one-hot target the size of the logits, so
autograd keeps several logits-sized tensors per image until backward. mmdetection's
RetinaNet calls mmcv's ``SigmoidFocalLossFunction`` instead (mmcv ``ops/focal_loss.py``):
it saves the logits and the long labels, returns a zero-initialised per-element loss that
one CUDA kernel fills, and in backward allocates one logits-sized gradient that another
kernel fills; mmdetection then weights that loss by the anchors' label weights (ignored
anchors weigh 0) and sums it (``weight_reduce_loss``).

``FusedFocalLoss`` has that memory layout without the kernels: its values are zeros
(vramplan never reads a loss's value; a measured run steps at learning rate 0).

>>> logits = torch.randn(6, 3, requires_grad=True)
>>> loss = FusedFocalLoss.apply(logits, torch.tensor([0, 1, 2, 3, 3, 0]))
>>> loss.shape, loss.sum().item()
(torch.Size([6, 3]), 0.0)
"""

from __future__ import annotations

import types

import torch
from torch import nn


class FusedFocalLoss(torch.autograd.Function):
    """mmcv's sigmoid focal loss kernel's tensors: saved logits and labels, a per-element
    loss, and a logits-sized gradient (see the module docstring)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(logits, labels)
        return logits.new_zeros(logits.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, _ = ctx.saved_tensors
        grad_logits = logits.new_zeros(logits.shape)
        grad_logits.mul_(grad)
        return grad_logits, None


def _fused_classification_loss(head, targets, head_outputs, matched_idxs) -> torch.Tensor:
    """mmdetection's RetinaHead classification loss over torchvision's head outputs: long
    labels (background = the class count), every anchor weighted 1 or, between the IoU
    thresholds, 0; normalised by the foreground count as both libraries do."""
    losses = []
    for target, logits, matched in zip(
        targets, head_outputs["cls_logits"], matched_idxs, strict=True
    ):
        foreground = matched >= 0
        num_foreground = foreground.sum()
        labels = torch.full_like(matched, logits.shape[-1])
        labels[foreground] = target["labels"][matched[foreground]]
        weight = (matched != head.BETWEEN_THRESHOLDS).to(logits.dtype)[:, None]
        loss = FusedFocalLoss.apply(logits, labels) * weight
        losses.append(loss.sum() / max(1, num_foreground))
    return sum(losses) / len(targets)


def use_fused_focal_loss(model: nn.Module) -> bool:
    """Give a torchvision RetinaNet mmdetection's fused focal loss; False when ``model``
    has no RetinaNet classification head."""
    head = getattr(getattr(model, "head", None), "classification_head", None)
    if head is None or not hasattr(head, "BETWEEN_THRESHOLDS"):
        return False
    head.compute_loss = types.MethodType(_fused_classification_loss, head)
    return True
