"""The registry: one ``OpRule`` per ATen op packet, filled by ``register`` and read by
lookups that accept a packet, an overload or the name a trace records.

The shape follows ``torch/utils/flop_counter.py`` (``@register_flop_formula(aten.mm)``):
rules are registered once, next to their sources, and the code that uses them only
looks them up::

    >>> library_of(torch.ops.aten.addmm), library_of("aten::convolution_backward.default")
    (<Library.MATMUL: 'matmul'>, <Library.CONVOLUTION: 'convolution'>)
    >>> str(autocast_of("layer_norm")), autocast_of("cat") is None
    ('fp32', True)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

import torch
from torch._ops import OpOverload, OpOverloadPacket


class _Named(str, Enum):
    def __str__(self) -> str:
        return self.value


class Library(_Named):
    """The GPU library an op runs in, for what that library adds beside the tensors."""

    MATMUL = "matmul"
    """cuBLAS / cuBLASLt: the first call in a phase creates their workspaces."""
    CONVOLUTION = "convolution"
    """cuDNN: each call takes a workspace while it runs (and loads cuDNN's kernels)."""


class Autocast(_Named):
    """CUDA autocast's cast policy (``at::autocast::CastPolicy``)."""

    LOWER_PRECISION = "lower"
    """Inputs cast to the autocast dtype (fp16/bf16)."""
    FP32 = "fp32"
    """Inputs cast to fp32."""
    FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"
    """Runs in fp32 through its ``dtype`` argument, unless the caller set one."""
    PROMOTE = "promote"
    """Runs in the widest floating dtype among its inputs."""
    BANNED = "banned"
    """Refused under autocast (unsafe in half precision)."""

    @property
    def runs_in_fp32(self) -> bool:
        return self in (Autocast.FP32, Autocast.FP32_SET_OPT_DTYPE)


@dataclass(frozen=True)
class OpRule:
    """What the registry knows of one ATen op packet (all its overloads)."""

    packet: OpOverloadPacket
    library: Library | None = None
    autocast: Autocast | None = None
    on_gpu: Callable[..., Any] | None = None
    """Room for what the op adds on the GPU beyond its outputs (none registered yet)."""

    @property
    def name(self) -> str:
        """The name a trace records for the op (``Trace.op_counts``, ``OpMarker.op``)."""
        return self.packet.__name__


_RULES: dict[OpOverloadPacket, OpRule] = {}
_BY_NAME: dict[str, OpRule] = {}

OpLike = OpOverloadPacket | OpOverload | str


def _packet(name: str) -> OpOverloadPacket | None:
    """The packet named ``name``; None for an op this PyTorch does not have (a newer one:
    it cannot appear in a trace here). ``tests/test_ops.py`` checks every name exists in the
    PyTorch the tests run on, so a misspelt name still fails there."""
    packet = getattr(torch.ops.aten, name, None)
    return packet if isinstance(packet, OpOverloadPacket) else None


def register(ops: Iterable[OpOverloadPacket | str], **fields: Any) -> None:
    """Set ``fields`` (``library``, ``autocast``, ``on_gpu``) on the rules of ``ops``
    (packets, or ATen base names). A field already set to another value is an error:
    one op, one answer."""
    for op in ops:
        packet = _packet(op) if isinstance(op, str) else op
        if packet is None:
            continue
        rule = _RULES.get(packet, OpRule(packet))
        for field, value in fields.items():
            old = getattr(rule, field)
            if old is not None and old != value:
                raise ValueError(f"{rule.name}: {field} is already {old!r}, not {value!r}")
        rule = replace(rule, **fields)
        _RULES[packet] = _BY_NAME[rule.name] = rule


def on_gpu(*ops: OpOverloadPacket) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator attaching what ``ops`` add on the GPU to their rules, as flop_counter's
    ``@register_flop_formula(aten.mm)`` attaches a formula: ``@on_gpu(aten.convolution)``."""

    def attach(function: Callable[..., Any]) -> Callable[..., Any]:
        register(ops, on_gpu=function)
        return function

    return attach


def rule(op: OpLike) -> OpRule | None:
    """The rule of a packet, an overload (``aten.mm.default``) or a name as traces and
    the dispatcher spell it (``"mm"``, ``"aten::mm"``, ``"aten::softmax.int"``)."""
    if isinstance(op, str):
        namespace, _, rest = op.rpartition("::")
        if namespace not in ("", "aten"):
            return None
        return _BY_NAME.get(rest.split(".")[0])
    packet = op if isinstance(op, OpOverloadPacket) else getattr(op, "overloadpacket", None)
    return _RULES.get(packet) if packet is not None else None


def library_of(op: OpLike) -> Library | None:
    found = rule(op)
    return found.library if found is not None else None


def autocast_of(op: OpLike) -> Autocast | None:
    """The op's class in CUDA's autocast lists; None for an op they do not name."""
    found = rule(op)
    return found.autocast if found is not None else None


def rules() -> tuple[OpRule, ...]:
    return tuple(_RULES.values())


def names(*, library: Library | None = None, autocast: Autocast | None = None) -> frozenset[str]:
    """Names of the ops with that library and/or autocast class."""
    return frozenset(
        r.name
        for r in _RULES.values()
        if (library is None or r.library is library)
        and (autocast is None or r.autocast is autocast)
    )
