"""Whether autograd still runs in a process forked from this one.

PyTorch's autograd engine starts its device threads at the first backward through a
device's tensors (a traced step's fake CUDA tensors start them); threads do not survive a
fork, so a process forked after that refuses to run backward
(https://github.com/pytorch/pytorch/wiki/Autograd-and-Fork). A backward of CPU tensors
alone leaves forks usable. The tracer notes each training step it traces (``step.py``), and
``plan`` and ``max-batch`` fork no workers after one (``planner/parallel.py``)::

    note_backward()           # as a training step is traced
    forked_autograd_runs()    # False from here on
"""

from __future__ import annotations

_ran_backward = False


def note_backward() -> None:
    """A training step, and so its backward, is traced in this process."""
    global _ran_backward
    _ran_backward = True


def forked_autograd_runs() -> bool:
    """Whether a process forked from this one now could run a traced backward: no traced
    backward has run here."""
    return not _ran_backward
