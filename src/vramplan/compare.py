"""Put an estimate beside a measurement of the same step: relative errors per figure.

>>> relative_error(110, 100)
0.1
"""

from __future__ import annotations

from dataclasses import dataclass

from vramplan.api import device_options, estimate_built
from vramplan.errors import UserError
from vramplan.estimate import Estimate
from vramplan.gpus import lookup_gpu
from vramplan.leak import LeakReport, check_leak
from vramplan.measure import Measurement, check_device, measure_built
from vramplan.sources import resolve
from vramplan.workload import Recipe

FIGURES = ("allocated", "reserved", "device_total")


def relative_error(estimated: int, measured: int) -> float:
    """(estimate − measurement) / measurement: negative means under-predicted."""
    return round((estimated - measured) / measured, 6) if measured else 0.0


@dataclass(frozen=True)
class Comparison:
    """An estimate, the measurement of the same step, their errors and the leak check."""

    estimate: Estimate
    measured: Measurement
    errors: dict[str, float]
    leak: LeakReport

    def to_json(self) -> dict:
        return {
            "schema": "vramplan.measure/1",
            "estimate": self.estimate.to_json(timeline=False),
            "measured": self.measured.to_json(),
            "errors": self.errors,
            "leak": self.leak.to_json(),
        }


def errors_of(estimate: Estimate, measured: Measurement) -> dict[str, float]:
    """Relative error of each figure both sides have."""
    pairs = {
        "allocated": (estimate.peak.allocated_bytes, measured.allocated_bytes),
        "reserved": (estimate.peak.reserved_bytes, measured.reserved_bytes),
        "device_total": (estimate.peak.device_total_bytes, measured.device_total_bytes),
    }
    return {
        name: relative_error(est, real)
        for name, (est, real) in pairs.items()
        if est is not None and real
    }


def _local_gpu() -> dict:
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    try:
        return {"gpu": lookup_gpu(props.name.replace("NVIDIA ", "")).name}
    except UserError:
        return {"gpu_memory": f"{props.total_memory}B"}


def measure_and_compare(
    model: str,
    recipe: Recipe,
    device: str | None = None,
    steps: int = 3,
    snapshot: str | None = None,
    alloc_conf: str | None = None,
) -> Comparison:
    """Estimate ``model`` for the device it will run on, run it, and compare."""
    device = check_device(device, steps)
    if device == "cuda":
        options = (
            device_options(alloc_conf=alloc_conf, **_local_gpu())
            if _has_cuda()
            else device_options(alloc_conf=alloc_conf)
        )
        estimate = estimate_built(resolve(model, recipe), recipe, "cuda", options)
    else:
        estimate = estimate_built(resolve(model, recipe), recipe, "cpu")
    measured = measure_built(resolve(model, recipe, device), recipe, device, steps, snapshot)
    return Comparison(
        estimate, measured, errors_of(estimate, measured), check_leak(measured.after_step_bytes)
    )


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
