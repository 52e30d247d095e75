"""Dropout as a CUDA GPU keeps it for backward, on the CPU's fake tensors.

``at::dropout`` takes the fused kernel only for CUDA (XPU, lazy, privateuse1) tensors with
``0 < p < 1`` and elements (``is_fused_kernel_acceptable`` in PyTorch's
``aten/src/ATen/native/Dropout.cpp``): ``native_dropout`` returns the output and a
1-byte mask (bool; ``_fused_dropout``'s uint8 before PyTorch 1.12), and backward keeps
only the mask. On the CPU the unfused path draws ``noise = empty_like(input)``, a tensor of
the input's dtype, and ``input * noise`` keeps it for backward: 4 bytes per element in fp32
where the GPU keeps 1. While tracing for a GPU, out-of-place ``_VF.dropout`` in training
runs ``native_dropout``, whose CPU kernel also returns a bool mask and whose autograd
formula saves only that mask::

    with cuda_dropout():
        y = F.dropout(x, 0.1, training=True)   # keeps a bool mask of x.numel() bytes

In-place dropout (``inplace=True``) takes the unfused path on CUDA too and is left alone.
"""

from __future__ import annotations

import contextlib

import torch
from torch import _VF

from vramplan.trace.patching import patched


def fused_on_cuda(input: torch.Tensor, p: float, train: bool) -> bool:
    """Whether CUDA's ``at::dropout`` would take the fused kernel for this call.

    >>> fused_on_cuda(torch.ones(3), 0.1, True), fused_on_cuda(torch.ones(3), 0.0, True)
    (True, False)
    """
    return bool(train) and 0.0 < p < 1.0 and input.numel() > 0


def cuda_dropout() -> contextlib.AbstractContextManager:
    """Route out-of-place training ``_VF.dropout`` calls to ``native_dropout``, as CUDA's
    ``at::dropout`` does."""
    original = _VF.dropout

    def dropout(input, p, train):
        if fused_on_cuda(input, p, train):
            return torch.native_dropout(input, p, True)[0]
        return original(input, p, train)

    return patched([(_VF, "dropout", dropout)])
