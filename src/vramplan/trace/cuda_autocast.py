"""CUDA's autocast rules, applied to the CPU tensors the tracer runs.

``torch.autocast("cpu")`` follows the CPU's op lists, which differ from CUDA's: on the CPU
``layer_norm``, ``softmax`` and ``sum`` run in the input's half precision, where CUDA runs
them in fp32 (PyTorch ``aten/src/ATen/autocast_mode.cpp``, ``TORCH_LIBRARY_IMPL(aten,
AutocastCUDA, m)``). While tracing, every op the installed PyTorch registers for
``AutocastCUDA`` gets a Python kernel on ``AutocastCPU`` applying CUDA's policy, and
every op only the CPU list casts falls through. Parameters cast to half precision are
cached once per autocast region, as CUDA's ``cached_cast`` does::

    with cuda_autocast(torch.bfloat16):
        logits = model(ids)          # layer_norm and softmax come out in fp32
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import cache

import torch
from torch.utils._pytree import tree_map

from vramplan.ops import Autocast, autocast_of


def policy_of(op_name: str) -> Autocast:
    """The op's class in CUDA's autocast lists (the op registry, ``vramplan.ops.cuda``);
    an op the installed PyTorch registers for AutocastCUDA but the lists do not name runs
    in fp32 (the newer entries, rms_norm and the upsample family, are fp32 ops).

    >>> [str(policy_of(n)) for n in ("aten::layer_norm", "aten::softmax.int", "aten::mm")]
    ['fp32', 'fp32_set_opt_dtype', 'lower']
    """
    return autocast_of(op_name) or Autocast.FP32


@cache
def registered_ops() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(ops with an AutocastCUDA kernel, ops with only an AutocastCPU kernel) in this torch."""
    names = torch._C._dispatch_get_all_op_names()
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    cuda = tuple(sorted(n for n in names if n.startswith("aten::") and has(n, "AutocastCUDA")))
    cpu_only = tuple(
        sorted(
            n for n in names if n.startswith("aten::") and has(n, "AutocastCPU") and n not in cuda
        )
    )
    return cuda, cpu_only


def _eligible(value) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and value.dtype != torch.float64
    )


class Caster:
    """Casts of one autocast region; parameters cast to half precision are cached."""

    def __init__(self, lower: torch.dtype) -> None:
        self.lower = lower
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def to_lower(self, value):
        if not _eligible(value) or value.dtype == self.lower:
            return value
        cacheable = (
            value.is_leaf
            and value.requires_grad
            and value.dtype == torch.float32
            and not value._is_view()
        )
        if cacheable and id(value) in self.cache:
            return self.cache[id(value)][1]
        cast = value.to(self.lower)
        if cacheable:
            self.cache[id(value)] = (value, cast)  # keep the source alive: ids stay unique
        return cast

    @staticmethod
    def to_fp32(value):
        return (
            value.to(torch.float32) if _eligible(value) and value.dtype != torch.float32 else value
        )


def _kernel(op, policy: Autocast, caster: Caster):
    exclude = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    dtype_positions = [i for i, arg in enumerate(op._schema.arguments) if arg.name == "dtype"]

    def run(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(exclude):
            if policy is Autocast.LOWER_PRECISION:
                args, kwargs = tree_map(caster.to_lower, (args, kwargs))
            elif policy is Autocast.FP32:
                args, kwargs = tree_map(caster.to_fp32, (args, kwargs))
            elif policy is Autocast.FP32_SET_OPT_DTYPE:
                first = next((a for a in args if isinstance(a, torch.Tensor)), None)
                given = kwargs.get("dtype") is not None or any(
                    i < len(args) and args[i] is not None for i in dtype_positions
                )
                if first is not None and _eligible(first) and not given and dtype_positions:
                    kwargs = {**kwargs, "dtype": torch.float32}
            elif policy is Autocast.PROMOTE:
                floats = [a.dtype for a in tree_map(lambda v: v, list(args)) if _eligible(a)]
                widest = torch.float32 if torch.float32 in floats else None
                if widest is not None:
                    args, kwargs = tree_map(caster.to_fp32, (args, kwargs))
            else:
                raise RuntimeError(
                    f"{op} is unsafe to autocast on CUDA; use binary_cross_entropy_with_logits"
                )
            return op(*args, **kwargs)

    return run


def _overload(name: str):
    base, _, overload = name.removeprefix("aten::").partition(".")
    packet = getattr(torch.ops.aten, base, None)
    if packet is None:
        return None
    return getattr(packet, overload or "default", None)


@contextlib.contextmanager
def cuda_rules(caster: Caster) -> Iterator[None]:
    """Register CUDA's autocast policies on the CPU autocast key for the block (a whole
    traced run: checkpointing recomputes forward inside backward, under the same rules).
    The weight-cast cache empties whenever PyTorch's own does: on leaving the outermost
    autocast context, which a checkpoint's recompute enters and leaves once per block."""
    library = torch.library.Library("aten", "IMPL")
    cuda_ops, cpu_only = registered_ops()
    clear_autocast_cache = torch.clear_autocast_cache

    def clear_both() -> None:
        clear_autocast_cache()
        caster.cache.clear()

    torch.clear_autocast_cache = clear_both
    try:
        for name in cuda_ops:
            op = _overload(name)
            if op is not None:
                library.impl(op, _kernel(op, policy_of(name), caster), "AutocastCPU")
        for name in cpu_only:
            op = _overload(name)
            if op is not None:
                library.impl(op, torch.library.fallthrough_kernel, "AutocastCPU")
        yield
    finally:
        torch.clear_autocast_cache = clear_autocast_cache
        library._destroy()


@contextlib.contextmanager
def autocast_region(caster: Caster) -> Iterator[None]:
    """One autocast region: CPU autocast (running CUDA's rules while ``cuda_rules`` is
    active); leaving it empties the weight-cast cache through ``cuda_rules``' hook on
    ``torch.clear_autocast_cache``, as on CUDA."""
    with torch.autocast("cpu", dtype=caster.lower):
        yield


@contextlib.contextmanager
def cuda_autocast(dtype: torch.dtype) -> Iterator[None]:
    """Run the block under autocast with CUDA's op policies (on CPU tensors)."""
    caster = Caster(dtype)
    with cuda_rules(caster), autocast_region(caster):
        yield
