"""An op call's arguments by the names its schema gives them (``convolution`` and
``convolution_backward`` order theirs differently; ``sum`` takes ``dim`` by position or
keyword)::

    >>> import torch
    >>> bound_arguments(torch.ops.aten.sum.dim_IntList, ("x", [0]), {"keepdim": True})
    {'self': 'x', 'dim': [0], 'keepdim': True}
"""

from __future__ import annotations


def bound_arguments(func, args: tuple, kwargs: dict | None) -> dict:
    """``args`` and ``kwargs`` of a call of ``func`` (an ATen overload) by argument name;
    AttributeError for a callable without a schema."""
    names = [a.name for a in func._schema.arguments]
    return dict(zip(names, args, strict=False)) | dict(kwargs or {})
