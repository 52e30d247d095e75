"""Device policies: what differs between running a step on the CPU and on a CUDA GPU.

The tracer always runs fake CPU tensors; a policy makes the trace look like the target::

    >>> CpuPolicy().optimizer_defaults()
    {}
    >>> CudaPolicy().optimizer_defaults()
    {'foreach': True}
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch

from vramplan.workload import Recipe


class DevicePolicy(Protocol):
    """Per-device rules the tracer applies while running fake CPU tensors."""

    name: str

    def optimizer_defaults(self) -> dict: ...

    def autocast(self, recipe: Recipe) -> contextlib.AbstractContextManager: ...

    def step_scalars_on_host(self) -> bool: ...

    def dispatch_modes(self, recipe: Recipe) -> list: ...


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


class CpuPolicy:
    """Run exactly as PyTorch runs on the CPU: the ground truth for CPU measurements."""

    name = "cpu"

    def optimizer_defaults(self) -> dict:
        return {}

    def autocast(self, recipe: Recipe) -> contextlib.AbstractContextManager:
        if not recipe.uses_autocast:
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=_dtype(recipe.compute_dtype_name))

    def step_scalars_on_host(self) -> bool:
        return False

    def dispatch_modes(self, recipe: Recipe) -> list:
        return []


class CudaPolicy(CpuPolicy):
    """What a CUDA GPU does differently: CUDA's autocast op lists and weight-cast cache,
    foreach optimizers by default, the optimizer's ``step`` counters kept on the host."""

    name = "cuda"

    def __init__(self, arch: str = "sm80") -> None:
        self.arch = arch

    def dispatch_modes(self, recipe: Recipe) -> list:
        from vramplan.trace.sdpa import CudaAttention

        return [CudaAttention(self.arch)]

    def autocast(self, recipe: Recipe) -> contextlib.AbstractContextManager:
        if not recipe.uses_autocast:
            return contextlib.nullcontext()
        from vramplan.trace.cuda_autocast import cuda_autocast

        return cuda_autocast(_dtype(recipe.compute_dtype_name))

    def optimizer_defaults(self) -> dict:
        return {"foreach": True}

    def step_scalars_on_host(self) -> bool:
        return True


@contextlib.contextmanager
def entered(modes: list) -> Iterator[None]:
    """Enter a list of context managers in order."""
    with contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        yield


def policy_for(target: str, arch: str = "sm80") -> DevicePolicy:
    """The policy for a target device name: ``cuda`` (default, of GPU ``arch``) or ``cpu``."""
    return CpuPolicy() if target == "cpu" else CudaPolicy(arch)
