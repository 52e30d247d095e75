"""A workbench that estimates a model under many recipes, counting and caching traces.

>>> bench = Workbench("torchvision:resnet18", device_options(gpu="t4"))   # doctest: +SKIP
>>> bench.estimate(Recipe(batch_size=64)).verdict.status                 # doctest: +SKIP
'fits'
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from vramplan.api import trace_and_estimate
from vramplan.device import DeviceOptions, apply_device
from vramplan.errors import UserError
from vramplan.estimate import Estimate
from vramplan.gpus import GpuSpec
from vramplan.sources import BuiltModel, resolve
from vramplan.trace.events import Trace
from vramplan.workload import Recipe


def recipe_key(recipe: Recipe) -> str:
    return json.dumps(recipe.to_json(), sort_keys=True)


@dataclass
class Workbench:
    """Estimates of one model under varying recipes on one device setting."""

    model: str
    device: DeviceOptions
    build: Callable[[str, Recipe], BuiltModel] = resolve
    traces: int = 0
    _done: dict[str, tuple[Estimate, Trace]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.device.gpu is None:
            raise UserError("planning needs a card: give --gpu NAME or --gpu-memory SIZE")

    def run(self, recipe: Recipe) -> tuple[Estimate, Trace]:
        """The estimate and trace of ``recipe`` (traced once, then cached)."""
        key = recipe_key(recipe)
        if key not in self._done:
            self.traces += 1
            self._done[key] = trace_and_estimate(
                self.build(self.model, recipe), recipe, "cuda", self.device
            )
        return self._done[key]

    def estimate(self, recipe: Recipe) -> Estimate:
        return self.run(recipe)[0]

    def fits(self, recipe: Recipe) -> bool:
        return self.estimate(recipe).verdict.status == "fits"

    def on(self, recipe: Recipe, gpu: GpuSpec) -> Estimate:
        """The same traced step judged against another card."""
        estimate, trace = self.run(recipe)
        options = DeviceOptions(
            gpu=gpu,
            headroom=self.device.headroom,
            alloc_conf=self.device.alloc_conf,
            cudnn_benchmark=self.device.cudnn_benchmark,
            data_parallel=self.device.data_parallel,
        )
        base = estimate.with_changes(
            peak=estimate.peak.__class__(
                allocated_bytes=estimate.details["tensor_allocated_bytes"],
                phase=estimate.peak.phase,
                iteration=estimate.peak.iteration,
            ),
            components=estimate.details["tensor_components"],
            runtime={},
            verdict=None,
        )
        return apply_device(base, trace, options)
