"""Put an estimate beside a measurement of the same step: relative errors per figure.

>>> relative_error(110, 100)
0.1
"""

from __future__ import annotations

from dataclasses import dataclass

from vramplan.measurement.leak import LeakReport
from vramplan.measurement.run import Measurement
from vramplan.result import Estimate

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

    def pairs(self) -> dict[str, tuple[int | None, int | None]]:
        """(estimate, measurement) of each figure, the device totals in one counter."""
        return figure_pairs(self.estimate, self.measured)

    def to_json(self) -> dict:
        return {
            "schema": "vramplan.measure/1",
            "estimate": self.estimate.to_json(timeline=False),
            "measured": self.measured.to_json(),
            "errors": self.errors,
            "leak": self.leak.to_json(),
        }


def figure_pairs(
    estimate: Estimate, measured: Measurement
) -> dict[str, tuple[int | None, int | None]]:
    """(estimate, measurement) per figure; the measured device total in the counter the
    estimate states (a per-process NVML reading gains the driver reserve for nvml-v1)."""
    counter = estimate.details.get("used_counter", "nvml-v1")
    return {
        "allocated": (estimate.peak.allocated_bytes, measured.allocated_bytes),
        "reserved": (estimate.peak.reserved_bytes, measured.reserved_bytes),
        "device_total": (estimate.peak.device_total_bytes, measured.device_total_in(counter)),
    }


def errors_of(estimate: Estimate, measured: Measurement) -> dict[str, float]:
    """Relative error of each figure both sides have."""
    return {
        name: relative_error(est, real)
        for name, (est, real) in figure_pairs(estimate, measured).items()
        if est is not None and real
    }
