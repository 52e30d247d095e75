"""The Estimate: one value that every renderer (terminal, JSON, HTML) and command shares.

Bytes are exact integers. ``to_json()`` produces the documented, versioned contract
``vramplan.estimate/1`` (see README, "JSON contract")::

    >>> from vramplan.analytic.calc import calculate
    >>> est = calculate(20_000_000, 32, 1_000_000, Recipe(optimizer="adam"))  # 20 M in fp32
    >>> est.peak.allocated_bytes
    448000000
    >>> est.to_json()["components"]["optimizer_state"]  # Adam: two fp32 moments
    160000000
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Literal

from vramplan.recipe import Recipe
from vramplan.version import __version__, library_versions

SCHEMA = "vramplan.estimate/1"


class _Named(str, Enum):
    """A string-valued enum that prints, formats and serialises as its value."""

    def __str__(self) -> str:
        return self.value


class Component(_Named):
    """What a byte at the peak is for (``components`` in the JSON contract)."""

    PARAMETERS = "parameters"
    BUFFERS = "buffers"
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATIONS = "activations"
    TEMPORARIES = "temporaries"
    INPUTS = "inputs"
    KV_CACHE = "kv_cache"
    """The key/value cache of generation (``--mode generate``)."""


class Phase(_Named):
    """Where in the step a byte was allocated.

    >>> f"{Phase.BACKWARD}", Phase.BACKWARD == "backward"
    ('backward', True)
    """

    SETUP = "setup"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


COMPONENTS = tuple(Component)
"""The components in the order renderers show them."""
Method = Literal["trace", "analytic", "calc", "layers"]


def empty_components() -> dict[str, int]:
    return dict.fromkeys(COMPONENTS, 0)


def five_part_summary(components: dict[str, int]) -> dict[str, int]:
    """The five parts the literature uses: parameters, gradients, optimizer state,
    activations (with the input batch) and workspace/temporaries.

    >>> five_part_summary({"parameters": 4, "buffers": 1, "gradients": 4, "optimizer_state": 8,
    ...                    "activations": 10, "temporaries": 2, "inputs": 3})
    {'parameters': 5, 'gradients': 4, 'optimizer_state': 8, 'activations': 13, 'workspace': 2}
    """
    return {
        "parameters": components.get(Component.PARAMETERS, 0)
        + components.get(Component.BUFFERS, 0),
        "gradients": components.get(Component.GRADIENTS, 0),
        "optimizer_state": components.get(Component.OPTIMIZER_STATE, 0),
        "activations": components.get(Component.ACTIVATIONS, 0)
        + components.get(Component.INPUTS, 0)
        + components.get(Component.KV_CACHE, 0),
        "workspace": components.get(Component.TEMPORARIES, 0),
    }


@dataclass(frozen=True)
class ModelInfo:
    """What was estimated: the source name and its parameter counts."""

    name: str
    parameters: int
    trainable_parameters: int
    parameter_bytes: int
    buffer_bytes: int = 0
    kind: str = "custom"
    architecture: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "architecture": self.architecture,
            "kind": self.kind,
            "parameters": self.parameters,
            "trainable_parameters": self.trainable_parameters,
            "parameter_bytes": self.parameter_bytes,
            "buffer_bytes": self.buffer_bytes,
        }


@dataclass(frozen=True)
class Peak:
    """The highest point of the step. ``allocated_bytes`` is what tensors occupy
    (``torch.cuda.max_memory_allocated``); ``reserved_bytes`` what the caching allocator
    holds (``max_memory_reserved``); ``device_total_bytes`` adds the runtime outside
    PyTorch (what ``nvidia-smi`` shows). The last two are filled by the device model."""

    allocated_bytes: int
    phase: Phase
    iteration: int = 2
    reserved_bytes: int | None = None
    device_total_bytes: int | None = None
    fragmentation_bytes: int | None = None
    reserved_range_bytes: tuple[int, int] | None = None
    """[low, high] of the reserved peak over the named unknowns (``details["range"]``)."""
    device_total_range_bytes: tuple[int, int] | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "allocated_bytes": self.allocated_bytes,
            "phase": self.phase,
            "iteration": self.iteration,
        }
        for name in ("reserved_bytes", "device_total_bytes", "fragmentation_bytes"):
            value = getattr(self, name)
            if value is not None:
                data[name] = value
        for name in ("reserved_range_bytes", "device_total_range_bytes"):
            value = getattr(self, name)
            if value is not None:
                data[name] = list(value)
        return data


@dataclass(frozen=True)
class ModuleUsage:
    """Activation bytes held at the peak that were produced inside one module."""

    name: str
    kind: str
    activation_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "activation_bytes": self.activation_bytes}


@dataclass(frozen=True)
class TimelinePoint:
    """Live bytes per component just after one traced allocation or free."""

    index: int
    phase: Phase
    iteration: int
    components: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.components.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "phase": self.phase,
            "iteration": self.iteration,
            "total": self.total,
            "components": self.components,
        }


@dataclass(frozen=True)
class Verdict:
    """Whether the step fits a card after a headroom margin."""

    gpu: str
    capacity_bytes: int
    headroom: float
    status: Literal["fits", "tight", "oom"]
    compared_bytes: int
    usable_bytes: int
    central_bytes: int
    """The job's central device total, read against the same line (``compared_bytes`` is
    its high end)."""

    @property
    def spare_bytes(self) -> int:
        """Bytes left under the headroom line (negative when missing)."""
        return self.usable_bytes - self.compared_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "capacity_bytes": self.capacity_bytes,
            "headroom": self.headroom,
            "status": self.status,
            "compared_bytes": self.compared_bytes,
            "usable_bytes": self.usable_bytes,
            "spare_bytes": self.spare_bytes,
            "central_bytes": self.central_bytes,
        }


@dataclass(frozen=True)
class Estimate:
    """The answer: peak, breakdown at the peak, and how it was obtained."""

    model: ModelInfo
    recipe: Recipe
    peak: Peak
    components: dict[str, int]
    method: Method = "trace"
    phase_peaks: dict[str, int] = field(default_factory=dict)
    top_modules: tuple[ModuleUsage, ...] = ()
    timeline: tuple[TimelinePoint, ...] = ()
    runtime: dict[str, int] = field(default_factory=dict)
    verdict: Verdict | None = None
    notes: tuple[str, ...] = ()
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def summary(self) -> dict[str, int]:
        return five_part_summary(self.components)

    def with_changes(self, **changes: Any) -> Estimate:
        return replace(self, **changes)

    def to_json(self, timeline: bool = True) -> dict[str, Any]:
        data: dict[str, Any] = {
            "schema": SCHEMA,
            "method": self.method,
            "units": "bytes",
            "model": self.model.to_json(),
            "recipe": self.recipe.to_json(),
            "peak": self.peak.to_json(),
            "components": dict(self.components),
            "summary": self.summary,
            "phase_peaks": dict(self.phase_peaks),
            "top_modules": [m.to_json() for m in self.top_modules],
            "notes": list(self.notes),
            "versions": {"vramplan": __version__, **library_versions()},
        }
        if self.runtime:
            data["runtime"] = dict(self.runtime)
        if self.verdict is not None:
            data["verdict"] = self.verdict.to_json()
        if self.details:
            data["details"] = self.details
        if timeline and self.timeline:
            data["timeline"] = [p.to_json() for p in self.timeline]
        return data
