"""The software stack whose runtime is emulated (``--stack torch2.14-cu12.8``): it decides
lazy or eager CUDA module loading, and names measured tables.

    >>> parse_stack("torch2.14-cu12.8").slug
    'torch2.14-cu12.8'
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from vramplan.device.table import runtime_table
from vramplan.errors import UserError


def stack_slug(torch: str, cuda: str) -> str:
    """``torch2.14-cu12.8`` from versions (major.minor of each)."""
    return f"torch{_minor(torch)}-cu{_minor(cuda)}"


def _minor(version: str) -> str:
    return ".".join(re.split(r"[.+]", str(version))[:2])


@dataclass(frozen=True)
class Stack:
    """The software stack whose runtime is emulated: PyTorch and CUDA versions.

    >>> parse_stack("torch2.14-cu12.8").lazy_loading
    True
    >>> parse_stack("torch1.12-cu11.6").lazy_loading
    False
    """

    torch: str
    cuda: str

    @property
    def slug(self) -> str:
        return stack_slug(self.torch, self.cuda)

    @property
    def lazy_loading(self) -> bool:
        """CUDA lazy module loading: CUDA >= 11.7 and PyTorch >= 1.13 (which sets
        ``CUDA_MODULE_LOADING=LAZY`` when unset)."""
        rule = runtime_table()["module_loading"]
        return _version(self.torch) >= _version(rule["lazy_from_torch"]) and _version(
            self.cuda
        ) >= _version(rule["lazy_from_cuda"])

    @property
    def foreach_default(self) -> bool:
        """Whether ``torch.optim`` runs its foreach implementation by default on CUDA
        (from PyTorch 2.0; a per-parameter loop before, with far smaller temporaries).

        >>> parse_stack("torch1.13-cu11.7").foreach_default
        False
        """
        rule = runtime_table()["optimizer_implementation"]
        return _version(self.torch) >= _version(rule["foreach_from_torch"])

    @property
    def zero_grad_frees(self) -> bool:
        """Whether ``zero_grad()`` sets gradients to None by default (from PyTorch 2.0);
        before, it zeroed them in place and they stayed allocated through the next forward.

        >>> parse_stack("torch1.10-cu11.2").zero_grad_frees
        False
        >>> parse_stack("torch2.0-cu11.8").zero_grad_frees
        True
        """
        rule = runtime_table()["zero_grad"]
        return _version(self.torch) >= _version(rule["set_to_none_from_torch"])

    @property
    def saves_every_operand(self) -> bool:
        """Whether autograd kept every operand of ``mul``/``div`` whatever required a
        gradient (before PyTorch 1.1; ``trace/legacy_saving.py``).

        >>> parse_stack("torch1.0-cu10.0").saves_every_operand
        True
        >>> parse_stack("torch1.1-cu10.0").saves_every_operand
        False
        """
        rule = runtime_table()["autograd_saving"]
        return _version(self.torch) < _version(rule["guarded_from_torch"])

    @property
    def cudnn_dropout_steps(self) -> bool:
        """Whether SDPA routes to cuDNN only a dropout in steps of 1/16 (from PyTorch 2.12;
        before, the usual 0.1 ran on cuDNN on sm90/sm100).

        >>> parse_stack("torch2.11-cu13.0").cudnn_dropout_steps
        False
        """
        rule = runtime_table()["sdpa_cudnn_dropout"]
        return _version(self.torch) >= _version(rule["steps_from_torch"])

    @property
    def softmax_keeps_input(self) -> bool:
        """Whether autograd kept a softmax's input as well as its output (before PyTorch
        1.11; ``trace/legacy_softmax.py``).

        >>> parse_stack("torch1.10-cu11.2").softmax_keeps_input
        True
        >>> parse_stack("torch1.11-cu11.3").softmax_keeps_input
        False
        """
        rule = runtime_table()["softmax_saving"]
        return _version(self.torch) < _version(rule["input_dropped_from_torch"])

    @property
    def checkpoint_saves_empty(self) -> bool:
        """Whether non-reentrant checkpointing saves an empty tensor before a checkpointed
        call's tensor arguments (PyTorch 2.1 to 2.11: ``_NoopSaveInputs``), which saved-tensor
        hooks see as one more tensor (``trace/tricks.Offloader`` numbers them).

        >>> parse_stack("torch2.11-cu13.0").checkpoint_saves_empty
        True
        >>> parse_stack("torch2.12-cu13.0").checkpoint_saves_empty
        False
        """
        rule = runtime_table()["checkpoint_input_saving"]
        version = _version(self.torch)
        return (
            _version(rule["empty_tensor_from_torch"])
            <= version
            < _version(rule["empty_tensor_until_torch"])
        )


def older_than_traced(stack: Stack) -> bool:
    """Whether ``stack`` emulates a PyTorch older than the installed one, whose operators
    the trace runs (rules that changed between them and are not modelled stay out of the
    range: the output says so).

    >>> older_than_traced(Stack("1.10", "11.2"))
    True
    """
    return _version(stack.torch) < _version(default_stack().torch)


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in str(text).split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def parse_stack(text: str) -> Stack:
    """``torch2.14-cu12.8`` → ``Stack("2.14", "12.8")`` (a UserError when malformed)."""
    match = re.fullmatch(r"torch(\d+\.\d+)(?:\.\d+)?-cu(\d+\.\d+)", text.strip().lower())
    if match is None:
        raise UserError(f"stack {text!r} is not like torch2.14-cu12.8")
    return Stack(match.group(1), match.group(2))


def default_stack() -> Stack:
    """The installed PyTorch, with its CUDA (12.8 for a CPU-only build: the CUDA of the
    current stable wheels)."""
    version = torch.__version__.split("+")[0]
    return Stack(".".join(version.split(".")[:2]), torch.version.cuda or "12.8")
