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

from torch.utils._python_dispatch import TorchDispatchMode

from vramplan.recipe import Recipe
from vramplan.trace.policy import CudaPolicy


class TotalFlops(TorchDispatchMode):
    """The FLOPs of every op run under it, by PyTorch's formulas; reset on entry."""

    def __init__(self) -> None:
        # Imported here: torch.utils.flop_counter loads triton (about 80 MiB resident and
        # 0.15 s), which only plan's recompute cost needs, not every estimate.
        from torch.utils.flop_counter import flop_registry

        super().__init__()
        self.formulas = flop_registry
        self.total = 0

    def __enter__(self) -> TotalFlops:
        self.total = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self.formulas.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out

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

    def dispatch_modes(self, recipe: Recipe) -> list:
        return [*super().dispatch_modes(recipe), self.counter]
