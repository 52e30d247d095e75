"""vramplan: how much GPU memory will this step take, where does it go, and does it fit?

A trace of a training step on a named card::

    import vramplan
    s = vramplan.Session("torchvision:resnet50", gpu="a100")
    s.estimate(batch_size=64).peak.device_total_bytes   # what nvidia-smi would show

and the classic arithmetic, without tracing:

>>> import vramplan
>>> est = vramplan.calc("20M", activations_per_sample="1M", batch_size=32, optimizer="none")
>>> est.peak.allocated_bytes   # 20 M fp32 weights and gradients, 32 x 1 M fp32 activations
288000000

``Session`` is the front door; ``estimate``, ``max_batch_size``, ``plan``, ``measure`` and
``estimate_step`` are one-call wrappers of it, and ``calc``, ``layers`` and ``llm`` answer
without tracing.
"""

from vramplan.api import (
    calc,
    calibrate,
    estimate,
    estimate_step,
    gpus,
    layers,
    llm,
    max_batch_size,
    measure,
    models,
    parallel_layout,
    plan,
)
from vramplan.distributed.layout import ParallelLayout
from vramplan.errors import UserError
from vramplan.measure.compare import Comparison
from vramplan.plan.answer import PlanAnswer
from vramplan.plan.search import SearchResult
from vramplan.recipe import Recipe
from vramplan.result import Component, Estimate, Phase
from vramplan.session import Session
from vramplan.version import __version__

__all__ = [
    "Session",
    "estimate",
    "estimate_step",
    "max_batch_size",
    "plan",
    "measure",
    "calc",
    "layers",
    "llm",
    "gpus",
    "models",
    "calibrate",
    "parallel_layout",
    "Recipe",
    "ParallelLayout",
    "Estimate",
    "SearchResult",
    "PlanAnswer",
    "Comparison",
    "Component",
    "Phase",
    "UserError",
    "__version__",
]
