"""Device policies: what differs between running a step on the CPU and on a CUDA GPU.

The tracer always runs fake CPU tensors; a policy makes the trace look like the target::

    >>> CpuPolicy().optimizer_defaults()
    {}
    >>> CudaPolicy().optimizer_defaults()
    {'foreach': True}
    >>> CudaPolicy(foreach=False).optimizer_defaults()  # PyTorch before 2.0
    {'foreach': False}
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from vramplan.recipe import Recipe
from vramplan.trace.kernel_scratch import Card, KernelScratch


class DevicePolicy(Protocol):
    """Per-device rules the tracer applies while running fake CPU tensors."""

    name: str
    frees_grads: bool
    """``zero_grad()``'s default: gradients set to None (PyTorch >= 2.0) or zeroed."""
    checkpoint_saves_empty: bool
    """Whether non-reentrant checkpointing saves an empty tensor before a call's arguments
    (PyTorch 2.1 to 2.11) where the installed PyTorch does not."""

    def optimizer_defaults(self) -> dict: ...

    def autocast(self, recipe: Recipe) -> contextlib.AbstractContextManager: ...

    def step_scalars_on_host(self) -> bool: ...

    def dispatch_modes(self, recipe: Recipe) -> list: ...

    def flop_counter(self) -> Any:
        """What counts the run's FLOPs on each op the recorder sees (``flops.TotalFlops``),
        or None."""
        ...

    def trace_notes(self) -> list[str]: ...

    def kernel_calls(self) -> dict[str, int]:
        """The per-kernel call counts ``trace_notes`` reports, live (a copied iteration,
        ``copied_iteration.py``, adds its calls to them)."""
        ...

    def kernel_scratch(self) -> Any:
        """What sizes the scratch the device's kernels take inside an op, for the recorder
        (``kernel_scratch.KernelScratch``), or None."""
        ...

    def trace_key(self) -> tuple:
        """What of the policy shapes a trace: equal for two policies that trace a recipe
        alike (the key a plan's short traces of repeated blocks are kept under beside the
        recipe's, ``trace/repeat.py``)."""
        ...


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


class CpuPolicy:
    """Run exactly as PyTorch runs on the CPU: the ground truth for CPU measurements. The
    scratch its slow convolution kernels allocate inside the op (im2col columns) is added to
    the trace (``cpu_conv.py``)."""

    name = "cpu"
    frees_grads = True  # the installed PyTorch (>= 2.0)
    checkpoint_saves_empty = False  # the installed PyTorch saves as it does

    def __init__(self) -> None:
        self._convolutions: dict[str, int] = {}

    def optimizer_defaults(self) -> dict:
        return {}

    def autocast(self, recipe: Recipe) -> contextlib.AbstractContextManager:
        if not recipe.uses_autocast:
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=_dtype(recipe.compute_dtype_name))

    def step_scalars_on_host(self) -> bool:
        return False

    def dispatch_modes(self, recipe: Recipe) -> list:
        from vramplan.trace.cpu_conv import CpuConvScratch

        self._convolutions = {}
        return [CpuConvScratch(self._convolutions)]

    def kernel_calls(self) -> dict[str, int]:
        return self._convolutions

    def kernel_scratch(self) -> None:
        return None  # the convolutions' is a dispatch mode's (cpu_conv.py)

    def trace_key(self) -> tuple:
        return (type(self), self.name)

    def flop_counter(self) -> None:
        return None

    def trace_notes(self) -> list[str]:
        kernels = sorted(k for k, n in self._convolutions.items() if n)
        if not kernels:
            return []
        note = f"convolution kernels as PyTorch picks them on this CPU: {', '.join(kernels)}"
        if any(kernel.startswith("Mkldnn") for kernel in kernels):
            note += " (oneDNN's scratchpad, sized by the implementation it picks, not counted)"
        return [note]


class CudaPolicy(CpuPolicy):
    """What a CUDA GPU does differently: CUDA's autocast op lists and weight-cast cache,
    foreach optimizers by default (``foreach``: PyTorch >= 2.0; a per-parameter loop before),
    the optimizer's ``step`` counters kept on the host; with ``saves_every_operand``
    (PyTorch before 1.1), autograd's old saving rule for mul/div (``legacy_saving.py``);
    with ``softmax_keeps_input`` (before 1.11), softmax's (``legacy_softmax.py``); with
    ``checkpoint_saves_empty`` (2.1 to 2.11), checkpointing's empty saved tensor, which
    activation offloading numbers (``tricks.Offloader``). ``arch`` names the GPU
    architecture, ``card`` what its kernels' launch configurations read (the scratch
    reductions and fused attention take inside an op, ``kernel_scratch.py``). One policy
    serves one traced run.

    ``F.scaled_dot_product_attention`` runs the kernel the GPU would pick (cuDNN, flash,
    memory-efficient or math; ``cuda_sdpa.py``), not the CPU's choice, LSTMs keep per-step
    gate state as on CUDA (``cuda_rnn.py``), and dropout keeps CUDA's 1-byte mask
    (``cuda_dropout.py``)."""

    name = "cuda"

    def __init__(
        self,
        arch: str = "sm80",
        foreach: bool = True,
        frees_grads: bool = True,
        saves_every_operand: bool = False,
        softmax_keeps_input: bool = False,
        cudnn_dropout_steps: bool = True,
        card: Card | None = None,
        checkpoint_saves_empty: bool = False,
    ) -> None:
        self.arch = arch
        self.checkpoint_saves_empty = checkpoint_saves_empty
        self.scratch = KernelScratch(card or Card())
        self.cudnn_dropout_steps = cudnn_dropout_steps
        self.foreach = foreach
        self.frees_grads = frees_grads
        self.saves_every_operand = saves_every_operand
        self.softmax_keeps_input = softmax_keeps_input
        self._caster = None
        self._kernels: dict[str, int] = {}

    def _caster_for(self, recipe: Recipe):
        from vramplan.trace.cuda_autocast import Caster

        if self._caster is None:
            self._caster = Caster(_dtype(recipe.compute_dtype_name))
        return self._caster

    def dispatch_modes(self, recipe: Recipe) -> list:
        from vramplan.trace.cuda_autocast import cuda_rules
        from vramplan.trace.cuda_dropout import cuda_dropout
        from vramplan.trace.cuda_rnn import cuda_lstm
        from vramplan.trace.cuda_sdpa import cuda_sdpa

        self._kernels = {}
        sdpa = cuda_sdpa(self.arch, self._kernels, self.cudnn_dropout_steps)
        modes = [sdpa, cuda_lstm(self._kernels), cuda_dropout()]
        if self.saves_every_operand:
            from vramplan.trace.legacy_saving import saving_every_operand

            modes.append(saving_every_operand())
        if self.softmax_keeps_input:
            from vramplan.trace.legacy_softmax import keeping_softmax_input

            modes.append(keeping_softmax_input())
        return modes + ([cuda_rules(self._caster_for(recipe))] if recipe.uses_autocast else [])

    def kernel_calls(self) -> dict[str, int]:
        return self._kernels

    def kernel_scratch(self) -> KernelScratch:
        return self.scratch

    def trace_key(self) -> tuple:
        """Every argument the policy was made with.

        >>> CudaPolicy(arch="sm90").trace_key() == CudaPolicy(arch="sm80").trace_key()
        False
        >>> CudaPolicy(card=Card(132)).trace_key() == CudaPolicy().trace_key()
        False
        """
        return (
            *super().trace_key(),
            self.arch,
            self.foreach,
            self.frees_grads,
            self.saves_every_operand,
            self.softmax_keeps_input,
            self.cudnn_dropout_steps,
            self.checkpoint_saves_empty,
            self.scratch.card,
        )

    def trace_notes(self) -> list[str]:
        calls = dict(self._kernels)
        notes = []
        if self.saves_every_operand:
            notes.append(
                "autograd as before PyTorch 1.1: mul/div keep both operands whenever one "
                "requires a gradient (a FrozenBatchNorm2d keeps its input)"
            )
        if self.softmax_keeps_input:
            notes.append("autograd as before PyTorch 1.11: softmax keeps its input too")
        lstm = calls.pop("lstm", 0)
        if calls:
            kernels = ", ".join(f"{name} x{n}" for name, n in sorted(calls.items()))
            notes.append(f"attention as the GPU runs it (PyTorch's SDPA selection): {kernels}")
        if lstm:
            notes.append(
                f"LSTM x{lstm} traced as PyTorch's native CUDA LSTM (per-step fused cells); "
                "cuDNN's reserve buffer, of unpublished size, keeps the same kind of state"
            )
        return notes

    def autocast(self, recipe: Recipe) -> contextlib.AbstractContextManager:
        if not recipe.uses_autocast:
            return contextlib.nullcontext()
        from vramplan.trace.cuda_autocast import autocast_region

        return autocast_region(self._caster_for(recipe))

    def optimizer_defaults(self) -> dict:
        return {"foreach": self.foreach}

    def step_scalars_on_host(self) -> bool:
        return True


@contextlib.contextmanager
def entered(modes: list) -> Iterator[None]:
    """Enter a list of context managers in order."""
    with contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        yield


def policy_for(
    target: str,
    arch: str = "sm80",
    foreach: bool = True,
    frees_grads: bool = True,
    saves_every_operand: bool = False,
    softmax_keeps_input: bool = False,
    cudnn_dropout_steps: bool = True,
    card: Card | None = None,
    checkpoint_saves_empty: bool = False,
) -> DevicePolicy:
    """The policy for a target device name: ``cuda`` (default, of GPU ``arch``; ``foreach``
    the emulated PyTorch's default optimizer implementation there, ``frees_grads`` its
    ``zero_grad()`` default, ``saves_every_operand`` its autograd saving rule for mul/div,
    ``softmax_keeps_input`` its rule for softmax, ``cudnn_dropout_steps`` its SDPA rule for
    dropout on cuDNN, ``card`` what its kernels' launches read, ``checkpoint_saves_empty``
    its checkpointing's saved inputs) or ``cpu``."""
    if target == "cpu":
        return CpuPolicy()
    return CudaPolicy(
        arch,
        foreach,
        frees_grads,
        saves_every_operand,
        softmax_keeps_input,
        cudnn_dropout_steps,
        card,
        checkpoint_saves_empty,
    )
