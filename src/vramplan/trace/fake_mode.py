"""PyTorch's ``FakeTensorMode`` with a cheaper cache key for the tensors a trace makes.

``FakeTensorMode`` caches what each op makes under a key built from its arguments; for a
fake tensor the key is a 17-field ``TensorMetadata`` read through Python properties, and
building it is over half of what an op costs in a trace (``python -m
benchmarks.speed.dispatch``). For a dense, strided fake tensor of this mode with static
sizes, all of those fields follow from ten: dtype, sizes, strides, device, storage
offset, storage bytes, ``requires_grad`` and the conjugate, negative and inference bits.
``KeyedFakeTensorMode`` keys such a tensor by one tuple of them, and plain constants by
their type and value, as PyTorch does; everything else (symbolic sizes, sparse or MKL-DNN
tensors, another mode's tensors, ``SymInt``, callables) goes to PyTorch's own method. Two
calls share a cache entry only where PyTorch's key would be equal too, and a key of this
form never equals one of PyTorch's (a tensor is a tuple here and a dtype there; a list's
length an int here and a string there).

Two ops the cache never takes are answered the way PyTorch answers them, without its
uncached path: ``_unsafe_view`` (every ``matmul`` of a batch ends in one) as ``view``,
whose sizes, strides and storage are the same and whose outputs are cached, and ``item()``
of a constant (the optimizer's step counts) from the constant itself. Pointwise foreach
ops over plain lists (a foreach optimizer's step) are answered without their meta
kernels (``fake_foreach.py``)::

    with fake_mode():
        x = torch.empty(4, 4, device="cuda")
        y = x + x                   # the second ``x + x`` is answered from the cache
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._mode_utils import no_dispatch

from vramplan.trace.fake_foreach import foreach_kind, pointwise_foreach

PLAIN = frozenset(
    {int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout}
    | {torch.memory_format}
)
"""Argument types keyed by type and value (as PyTorch's key does: ``1`` and ``1.0``
differ by type)."""
_KEYED_PARAMETERS = ["self", "result", "args", "state", "id_hashed_objects"]
_UNSAFE_VIEW = torch.ops.aten._unsafe_view.default
_VIEW = torch.ops.aten.view.default
_ITEM = torch.ops.aten._local_scalar_dense.default


class KeyedFakeTensorMode(FakeTensorMode):
    """``FakeTensorMode`` whose cache key reads a dense fake tensor in one tuple."""

    def dispatch(self, func, types, args=(), kwargs=None):
        if func is _UNSAFE_VIEW and not kwargs:
            with contextlib.suppress(RuntimeError, ValueError):  # not viewable: PyTorch's error
                return super().dispatch(_VIEW, types, args, kwargs)
        elif func is _ITEM and self._constant(args[0]):
            with no_dispatch():  # what PyTorch's constant propagation runs
                return func(args[0].constant)
        elif foreach_kind(func) is not None:
            answer = pointwise_foreach(self, self._dense, func, args, kwargs or {})
            if answer is not NotImplemented:
                return answer
        return super().dispatch(func, types, args, kwargs)

    def _constant(self, tensor) -> bool:
        """Whether ``tensor`` is this mode's and holds a constant."""
        mine = type(tensor) is FakeTensor and tensor.fake_mode is self
        return mine and tensor.constant is not None

    def _prep_args_for_hash(self, result, args, state, id_hashed_objects) -> None:
        if isinstance(args, (list, tuple, dict)):
            result.append(type(args))
            result.append(len(args))
        if isinstance(args, dict):
            self._prep_args_for_hash(result, args.keys(), state, id_hashed_objects)
            self._prep_args_for_hash(result, args.values(), state, id_hashed_objects)
            return
        for arg in args:
            kind = type(arg)
            if kind is FakeTensor and self._dense(arg):
                result.append(tensor_key(arg))
            elif kind in PLAIN:
                result.append(kind)
                result.append(arg)
            elif isinstance(arg, (list, tuple, dict)):
                self._prep_args_for_hash(result, arg, state, id_hashed_objects)
            else:
                super()._prep_args_for_hash(result, (arg,), state, id_hashed_objects)

    def _dense(self, tensor: FakeTensor) -> bool:
        """Whether ``tensor`` is this mode's, strided, with static sizes and no constant
        (what ``tensor_key`` describes whole)."""
        return (
            tensor.fake_mode is self
            and tensor.constant is None
            and not tensor._has_symbolic_sizes_strides
            and tensor.layout is torch.strided
        )


def tensor_key(tensor: FakeTensor) -> tuple:
    """What a dense fake tensor's cache key holds: every field of PyTorch's
    ``TensorMetadata`` is one of these or follows from them (memory format from sizes and
    strides, quantization from the dtype; strided, so neither sparse nor coalesced).

    >>> with KeyedFakeTensorMode():
    ...     key = tensor_key(torch.empty(2, 3, device="cuda"))
    >>> key[:4]
    (torch.float32, (2, 3), (3, 1), device(type='cuda', index=0))
    """
    return (
        tensor.dtype,
        tuple(tensor.shape),
        tensor.stride(),
        tensor.fake_device,
        tensor.storage_offset(),
        tensor.untyped_storage().nbytes(),
        tensor.requires_grad,
        tensor.is_conj(),
        tensor.is_neg(),
        tensor.is_inference(),
    )


def _keyed_mode_applies() -> bool:
    """Whether the installed torch builds its cache key with the method the keyed mode
    overrides (PyTorch 2.4 and later)."""
    method = getattr(FakeTensorMode, "_prep_args_for_hash", None)
    return method is not None and list(inspect.signature(method).parameters) == _KEYED_PARAMETERS


TRACE_MODE = KeyedFakeTensorMode if _keyed_mode_applies() else FakeTensorMode
"""The mode traces run in: the keyed one where the installed torch allows it."""


def fake_mode() -> FakeTensorMode:
    """A fresh mode for one trace (``TRACE_MODE``)."""
    return TRACE_MODE()
