"""Pointwise ``torch._foreach_*`` ops answered without running their meta kernels.

A foreach optimizer (PyTorch 2.0+'s default on CUDA) updates every parameter with a few
list ops: AdamW's step is ``_foreach_lerp_``, ``_foreach_addcmul_``, ``_foreach_sqrt``,
``_foreach_addcdiv_`` and the like over all of them at once. ``FakeTensorMode`` answers a
foreach op by running its meta kernel (``fake_impls.foreach_run_and_map_input_device``),
which decomposes it into one pointwise op per tensor through PyTorch's reference
implementations, uncached: a third of a traced ViT-B/16 step was its two AdamW steps.

Where every tensor of the op's lists is a dense, contiguous floating-point fake tensor of
the mode, the lists are as long as each other, the tensors at each index share shape,
dtype and device, and the other arguments are Python numbers (or lists of them), the
answer is known without the kernel: an in-place op (``_foreach_mul_``) writes its first
list and returns nothing; an out-of-place one (``_foreach_sqrt``) returns one new
contiguous tensor per index with the shape, dtype and device of the first list's, as
the meta kernel's per-tensor ops do (pointwise ops of one floating dtype with Python
numbers keep that dtype). Anything else, a tensor operand (``_foreach_add_(steps,
one)``), a reduction (``_foreach_norm``) or mismatched lists (an error PyTorch raises),
goes to PyTorch's own path::

    with KeyedFakeTensorMode():
        exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)   # no meta kernel run
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, in_kernel_invocation_manager

POINTWISE = frozenset(
    {"add", "sub", "mul", "div", "addcmul", "addcdiv", "lerp", "sqrt", "rsqrt", "neg"}
    | {"abs", "sign", "exp", "reciprocal", "maximum", "minimum", "clamp_min", "clamp_max"}
    | {"pow", "zero", "copy"}
)
"""Foreach ops (by base name) whose result at each index is one pointwise op of the
tensors there: the same shape, no reduction."""
FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
NUMBERS = (int, float, bool)
PREFIX = "_foreach_"

_kinds: dict[torch._ops.OpOverload, str | None] = {}


def foreach_kind(func: torch._ops.OpOverload) -> str | None:
    """``"inplace"`` or ``"new"`` for a pointwise foreach op, None for any other op.

    >>> aten = torch.ops.aten
    >>> foreach_kind(aten._foreach_mul_.Scalar), foreach_kind(aten._foreach_sqrt.default)
    ('inplace', 'new')
    >>> foreach_kind(aten._foreach_norm.Scalar), foreach_kind(aten.add.Tensor)
    (None, None)
    """
    if func not in _kinds:
        name = getattr(func, "_opname", "")
        base = name[len(PREFIX) :].removesuffix("_") if name.startswith(PREFIX) else ""
        kind = None
        if base in POINTWISE and func.namespace == "aten":
            kind = "inplace" if name.endswith("_") else "new"
        _kinds[func] = kind
    return _kinds[func]


def pointwise_foreach(
    mode: FakeTensorMode,
    dense: Callable[[FakeTensor], bool],
    func: torch._ops.OpOverload,
    args: Sequence[object],
    kwargs: Mapping[str, object],
) -> object:
    """What ``mode`` would answer for the pointwise foreach op ``func``, without its meta
    kernel; ``NotImplemented`` where the shortcut does not apply (then PyTorch's path).
    ``dense`` tells the mode's own strided fake tensors of static sizes holding no
    constant (``KeyedFakeTensorMode``'s)."""
    kind = foreach_kind(func)
    if kind is None or not args or not isinstance(args[0], list | tuple) or not args[0]:
        return NotImplemented
    lists = _tensor_lists(dense, (*args, *kwargs.values()), len(args[0]))
    if lists is None:
        return NotImplemented
    if kind == "inplace":
        return None
    outputs = []
    with in_kernel_invocation_manager(mode):
        for tensor in lists[0]:
            meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
            outputs.append(
                mode.fake_tensor_converter.from_meta_and_device(mode, meta, tensor.fake_device)
            )
    return outputs


def _tensor_lists(
    dense: Callable[[FakeTensor], bool], arguments: Sequence[object], length: int
) -> list[Sequence[FakeTensor]] | None:
    """The op's tensor lists where the shortcut applies to them all, else None."""
    lists = []
    for argument in arguments:
        if isinstance(argument, list | tuple):
            if len(argument) != length:
                return None
            if all(type(item) is FakeTensor for item in argument):
                lists.append(argument)
            elif not all(type(item) in NUMBERS for item in argument):
                return None
        elif argument is not None and type(argument) not in NUMBERS:
            return None
    if not lists or lists[0] is not arguments[0]:
        return None
    for tensors in zip(*lists, strict=True):
        first = _signature(tensors[0])
        if first[0] not in FLOATS or any(_signature(t) != first for t in tensors[1:]):
            return None
        if not all(dense(t) and t.is_contiguous() for t in tensors):
            return None
    return lists


def _signature(tensor: FakeTensor) -> tuple:
    return tensor.dtype, tensor.shape, tensor.fake_device
