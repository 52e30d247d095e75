"""Autograd's gradient accumulation as the engine does it on real tensors: in place.

Where two gradients meet at one tensor (a residual stream, a weight used twice, rotary's
two halves, RMSNorm's two paths), the engine's ``InputBuffer`` sums them after the node
that produced the second one (``torch/csrc/autograd/input_buffer.cpp``, ``accumulate``):
with grad mode off, into the first gradient's storage (``old_var.add_(var)``) when
``can_accumulate_inplace(old_var)``: a dense tensor, no subclass, the buffer holding the
only reference to it and to its storage (a view's base holds the storage too: a linear
layer's weight gradient, the transpose of a matmul, is summed into a new tensor, as the
H200 showed for tied embeddings); else into a new tensor. Under fake tensors, subclasses,
every sum is a new tensor: one request per meeting that the GPU never makes (the H200's
Qwen2.5-0.5B step: two 2 MiB, five 14 MiB and two 28 MiB per layer).

The tracer opens a window after every node of the graph runs (a post hook) and closes it
at the next op that is not such an ``add`` (and when the next node starts, a pre hook).
Where the sum's first operand, not a view, dies before the next op (the buffer held its
only reference), the recorder writes the sum as made in that storage: no free, no new
block, the operand's record living on with the sum's lifetime and tags
(``AllocationRecorder._continue``); the sum's own record holds no bytes.

The same holds for ``index``'s backward (``index_backward_put``): on real tensors it
scatters the gradient in place into its zeros, on subclasses into a new tensor.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false

ADD = torch.ops.aten.add.Tensor
INDEX_PUT = torch.ops.aten.index_put.default


def graph_nodes(root) -> Iterator:
    """Every node reachable from ``root`` (a ``grad_fn``) through ``next_functions``."""
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(next_node for next_node, _ in node.next_functions)


def backward_in_place(loss: torch.Tensor, recorder) -> None:
    """``loss.backward()`` with ``recorder.opened(True)`` after each node runs and
    ``opened(False)`` before the next one does."""
    handles = []
    for node in graph_nodes(loss.grad_fn):
        handles.append(node.register_prehook(lambda grads: recorder.opened(False)))
        handles.append(node.register_hook(lambda grads_in, grads_out: recorder.opened(True)))
    try:
        loss.backward()
    finally:
        recorder.opened(False)
        for handle in handles:
            handle.remove()


def accumulates(out, a, b) -> bool:
    """Whether an ``add`` in a window can be the engine's in-place sum into ``a``: two
    tensors of one shape and dtype, ``a`` dense and not a view."""
    return (
        isinstance(out, torch.Tensor)
        and isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.shape == b.shape
        and a.dtype == b.dtype
        and not a._is_view()
        and is_non_overlapping_and_dense_or_false(a)
    )


def index_backward_put(args: tuple, kwargs: dict) -> bool:
    """Whether an out-of-place ``index_put`` is ``index``'s backward scattering the gradient
    into its zeros: autograd's ``index_backward`` takes that path only for tensor
    subclasses (fake tensors among them) and ``_index_put_impl_`` in place into the zeros
    on real tensors (``torch/csrc/autograd/FunctionsManual.cpp``), so the result is the
    zeros' storage, which dies as ``index_backward`` returns.

    >>> index_backward_put((torch.zeros(3), [torch.tensor([0])], torch.ones(1), True), {})
    False
    """
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    node = torch._C._current_autograd_node()
    return bool(accumulate) and type(node).__name__ == "IndexBackward0"
