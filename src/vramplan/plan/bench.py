"""A workbench that estimates a model under many recipes, counting and caching traces::

bench = Workbench("torchvision:resnet18", device_options(gpu="t4"))
bench.estimate(Recipe(batch_size=64)).verdict.status   # 'fits'; traced once, then cached
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from vramplan.device.catalog import GpuSpec
from vramplan.device.options import DeviceOptions
from vramplan.device.profile import profile_for
from vramplan.device.replay import apply_device
from vramplan.errors import UserError
from vramplan.pipeline import estimate_built, estimate_from_trace, trace_and_estimate
from vramplan.recipe import Recipe
from vramplan.result import Estimate
from vramplan.sources import BuiltModel, resolve
from vramplan.trace.events import Trace


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

    def built(self, recipe: Recipe) -> BuiltModel:
        """The model built (on the meta device) for ``recipe``."""
        return self.build(self.model, recipe)

    def run(self, recipe: Recipe) -> tuple[Estimate, Trace]:
        """The estimate and trace of ``recipe`` (traced once, then cached)."""
        key = recipe_key(recipe)
        if key not in self._done:
            self.traces += 1
            self._done[key] = trace_and_estimate(self.built(recipe), recipe, "cuda", self.device)
        return self._done[key]

    def estimate(self, recipe: Recipe) -> Estimate:
        return self.run(recipe)[0]

    def sharded(self, recipe: Recipe, engine: Any) -> Estimate:
        """One rank of ``recipe`` traced under a sharding ``engine`` (``Fsdp2``)."""
        self.traces += 1
        device = replace(self.device, data_parallel=engine.world_size)
        return estimate_built(self.built(recipe), recipe, "cuda", device, engine)

    def fits(self, recipe: Recipe) -> bool:
        return self.estimate(recipe).verdict.status == "fits"

    def on(self, recipe: Recipe, gpu: GpuSpec) -> Estimate:
        """The same traced step judged against another card."""
        estimate, trace = self.run(recipe)
        options = replace(self.device, gpu=gpu, profile=profile_for(gpu.name))
        tensor_level = estimate_from_trace(trace, estimate.model, recipe, "cuda", list(trace.notes))
        return apply_device(tensor_level, trace, options)
