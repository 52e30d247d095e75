"""The step's FLOPs counted in the same traced run as its memory.

PyTorch's ``FlopCounterMode`` (``torch/utils/flop_counter.py``) changes the run it counts:
an op without a FLOP formula that has a composite kernel (``silu_backward``) is decomposed
into its parts (``func.decompose()``), which allocate other temporaries than the op the GPU
runs, and its ``ModuleTracker`` hooks every module. ``TotalFlops`` sums the same formulas
(``flop_registry``) over the ops as they run, decomposing nothing and hooking no module, so
the traced events stay those of the plain policy and one trace answers both the memory and
the recompute cost (``tests/test_flops.py``)::

    policy = FlopCountingPolicy("sm80")
    trace = trace_training(built, recipe, policy)
    policy.counter.get_total_flops()
"""

from __future__ import annotations

from vramplan.trace.policy import CudaPolicy


class TotalFlops:
    """The FLOPs of every op the recorder sees, by PyTorch's formulas
    (``AllocationRecorder(counter=...)`` calls ``count`` on each op it dispatches: one
    dispatch mode for both: a mode of its own made each trace 10-20% slower).

    >>> import torch
    >>> counter = TotalFlops()
    >>> a, b = torch.ones(2, 3), torch.ones(3, 4)
    >>> counter.count(torch.ops.aten.mm.default, (a, b), {}, a @ b)
    >>> counter.get_total_flops()  # 2 * 2 * 3 * 4
    48
    """

    def __init__(self) -> None:
        # Imported here: torch.utils.flop_counter loads triton (about 80 MiB resident and
        # 0.15 s), which only plan's recompute cost needs, not every estimate.
        from torch.utils.flop_counter import flop_registry

        self.formulas = flop_registry
        self.total = 0

    def reset(self) -> None:
        """Start a new run's count (each traced run of the policy starts from 0)."""
        self.total = 0

    def count(self, func, args: tuple, kwargs: dict, out) -> None:
        """Add ``func(*args, **kwargs)``'s FLOPs (``out`` its result)."""
        formula = self.formulas.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)

    def get_total_flops(self) -> int:
        return self.total

    def add(self, flops: int) -> None:
        """Count ``flops`` of ops not run under it (``copied_iteration.py``'s copied passes)."""
        self.total += flops


class FlopCountingPolicy(CudaPolicy):
    """The CUDA policy plus a FLOP counter over the whole traced run (``counter``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.counter = TotalFlops()

    def flop_counter(self) -> TotalFlops:
        return self.counter
