"""Per-op rules keyed by ATen op packets: the GPU library an op runs in (cuBLAS, cuDNN)
and its class in CUDA's autocast lists. ``registry`` holds the mechanism, ``cuda`` the
rules (registered on import)::

    >>> import torch
    >>> from vramplan import ops
    >>> ops.library_of(torch.ops.aten.mm), str(ops.autocast_of("aten::softmax.int"))
    (<Library.MATMUL: 'matmul'>, 'fp32_set_opt_dtype')
"""

from vramplan.ops import cuda  # noqa: F401  (registers CUDA's rules)
from vramplan.ops.registry import (
    Autocast,
    Library,
    OpRule,
    autocast_of,
    library_of,
    names,
    on_gpu,
    register,
    rule,
    rules,
)

__all__ = [
    "Autocast",
    "Library",
    "OpRule",
    "autocast_of",
    "library_of",
    "names",
    "on_gpu",
    "register",
    "rule",
    "rules",
]
