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

from typing import TYPE_CHECKING

from vramplan.errors import UserError
from vramplan.recipe import Recipe
from vramplan.result import Component, Estimate, Phase
from vramplan.version import __version__

if TYPE_CHECKING:
    from vramplan.api import (
        calibrate,
        estimate,
        estimate_step,
        max_batch_size,
        measure,
        parallel_layout,
        plan,
        serve,
    )
    from vramplan.configs import TrainingConfig, read_config
    from vramplan.distributed.layout import ParallelLayout
    from vramplan.measurement.compare import Comparison
    from vramplan.planner.answer import PlanAnswer
    from vramplan.planner.search import SearchResult
    from vramplan.planner.serving import ServingPlan
    from vramplan.quick import ModelMatch, calc, find_models, gpus, layers, llm, models, tasks
    from vramplan.session import Session

# Where each public name lives. Importing the package imports none of them: torch (and the
# model libraries) load on the first use of a name that needs them, so ``vramplan calc``,
# ``llm``, ``gpus`` and ``--help`` start without torch (PEP 562).
_LAZY = {
    "Session": "vramplan.session",
    "estimate": "vramplan.api",
    "estimate_step": "vramplan.api",
    "max_batch_size": "vramplan.api",
    "plan": "vramplan.api",
    "measure": "vramplan.api",
    "calibrate": "vramplan.api",
    "parallel_layout": "vramplan.api",
    "calc": "vramplan.quick",
    "layers": "vramplan.quick",
    "llm": "vramplan.quick",
    "gpus": "vramplan.quick",
    "models": "vramplan.quick",
    "find_models": "vramplan.quick",
    "ModelMatch": "vramplan.quick",
    "tasks": "vramplan.quick",
    "ParallelLayout": "vramplan.distributed.layout",
    "SearchResult": "vramplan.planner.search",
    "PlanAnswer": "vramplan.planner.answer",
    "Comparison": "vramplan.measurement.compare",
    # serving capacity (planner/serving.py)
    "serve": "vramplan.api",
    "ServingPlan": "vramplan.planner.serving",
    "read_config": "vramplan.configs",
    "TrainingConfig": "vramplan.configs",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vramplan' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


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
    "find_models",
    "ModelMatch",
    "tasks",
    "calibrate",
    "parallel_layout",
    "Recipe",
    "ParallelLayout",
    "Estimate",
    "SearchResult",
    "PlanAnswer",
    "Comparison",
    "serve",
    "ServingPlan",
    "read_config",
    "TrainingConfig",
    "Component",
    "Phase",
    "UserError",
    "__version__",
]
