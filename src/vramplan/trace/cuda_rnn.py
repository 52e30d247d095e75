"""LSTMs as a CUDA GPU keeps them for backward, on the CPU's fake tensors.

On the CPU, ``nn.LSTM`` runs oneDNN's fused layer, whose meta kernel reports no
workspace, so a fake trace sees only the layer outputs. On a GPU, cuDNN keeps a reserve
buffer of per-step gate activations whose size cuDNN does not publish; PyTorch's own CUDA
LSTM without cuDNN keeps the same kind of state explicitly: the input projections of all
steps at once, then per step one fused cell (``_thnn_fused_lstm_cell``) saving a
(batch, 4·hidden) gate workspace and the cell state. While tracing for a GPU, ``_VF.lstm``
runs that native CUDA algorithm through its ATen ops (meta kernels and autograd formulas
from PyTorch), the stand-in for cuDNN's reserve::

    calls = {}
    with cuda_lstm(calls):
        out, (h, c) = nn.LSTM(128, 256, 2)(x)   # on fake tensors; calls["lstm"] == 1
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import _VF

from vramplan.trace.patching import patched

aten = torch.ops.aten


def _direction(steps: torch.Tensor, h, c, weights, reverse: bool):
    """One direction of one layer over (T, B, F) inputs; returns (outputs, h, c)."""
    w_ih, w_hh, b_ih, b_hh = weights
    gates_in = F.linear(steps, w_ih)  # every step's input projection at once
    outputs = []
    order = range(steps.size(0) - 1, -1, -1) if reverse else range(steps.size(0))
    for t in order:
        h, c, _ = aten._thnn_fused_lstm_cell(gates_in[t], F.linear(h, w_hh), c, b_ih, b_hh)
        outputs.append(h)
    if reverse:
        outputs.reverse()
    return torch.stack(outputs), h, c


def native_lstm(x, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    """``_VF.lstm`` (dense input, no projection) as PyTorch's CUDA LSTM runs it without
    cuDNN."""
    h0, c0 = hx
    directions = 2 if bidirectional else 1
    per = 4 if has_biases else 2
    layer_input = x.transpose(0, 1) if batch_first else x
    hs, cs = [], []
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            index = layer * directions + direction
            weights = list(params[index * per : (index + 1) * per])
            if not has_biases:  # the meta kernel wants biases: zeros, without gradients
                zeros = torch.zeros(weights[0].size(0), dtype=weights[0].dtype)
                weights += [zeros, zeros]
            out, h, c = _direction(layer_input, h0[index], c0[index], weights, direction == 1)
            outputs.append(out)
            hs.append(h)
            cs.append(c)
        layer_input = torch.cat(outputs, dim=-1) if directions == 2 else outputs[0]
        if dropout and train and layer < num_layers - 1:
            layer_input = F.dropout(layer_input, dropout, training=True)
    output = layer_input.transpose(0, 1) if batch_first else layer_input
    return output, torch.stack(hs), torch.stack(cs)


def cuda_lstm(calls: dict[str, int]) -> contextlib.AbstractContextManager:
    """Route dense ``_VF.lstm`` calls without projections to ``native_lstm``, counting
    them in ``calls["lstm"]``; packed sequences and projections run as on the CPU."""
    original = _VF.lstm

    def lstm(*args, **kwargs):
        hx = args[1]
        dense = not isinstance(hx, torch.Tensor) and len(args) == 9 and not kwargs
        if not dense or hx[0].size(-1) != hx[1].size(-1):  # packed, or proj_size > 0
            return original(*args, **kwargs)
        calls["lstm"] = calls.get("lstm", 0) + 1
        return native_lstm(*args)

    return patched([(_VF, "lstm", lstm)])
