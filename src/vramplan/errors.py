"""Errors a user can cause.

The command line turns a ``UserError`` into one line on stderr and exit code 2::

    raise UserError("batch size must be a positive integer, got 0")
"""

from __future__ import annotations


class UserError(ValueError):
    """A problem with what the user asked for (a name, a path, a shape, a flag)."""


CUDA_HINT = (
    "vramplan traces on the CPU with fake tensors and never uses a GPU: build the model "
    "without .cuda()/.to('cuda') and without requiring torch.cuda.is_available() "
    "(--gpu names the card to emulate)"
)


def cuda_hint(exc: BaseException) -> str:
    """``"; " + CUDA_HINT`` when ``exc`` reads like code that wanted a GPU, else ``""``.

    >>> cuda_hint(RuntimeError("Found no NVIDIA driver on your system"))[:30]
    '; vramplan traces on the CPU w'
    """
    text = str(exc)
    wanted_gpu = any(w in text for w in ("CUDA", "cuda", "NVIDIA", "GPU", "nvidia"))
    return f"; {CUDA_HINT}" if wanted_gpu else ""
