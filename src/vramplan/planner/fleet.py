"""Which catalog GPUs fit a step, and with which levers when it does not fit as it is::

rows = gpus_that_fit(bench, Recipe(batch_size=32), plan)
rows[0].gpu, rows[0].status, rows[0].levers
# e.g. ('T4', 'oom', 'mixed precision + activation checkpointing')
"""

from __future__ import annotations

from dataclasses import dataclass

from vramplan.device.catalog import GpuSpec, catalog
from vramplan.planner.bench import Workbench
from vramplan.planner.levers import LeverResult
from vramplan.recipe import Recipe


@dataclass(frozen=True)
class GpuFit:
    """One card's verdict on the step, and the first lever set that makes it fit."""

    gpu: str
    capacity_bytes: int
    status: str
    device_total_bytes: int
    levers: str = ""
    flags: str = ""

    def to_json(self) -> dict:
        return {
            "gpu": self.gpu,
            "capacity_bytes": self.capacity_bytes,
            "status": self.status,
            "device_total_bytes": self.device_total_bytes,
            "levers": self.levers,
            "flags": self.flags,
        }


def gpus_that_fit(
    bench: Workbench,
    recipe: Recipe,
    options: list[LeverResult],
    gpus: tuple[GpuSpec, ...] | None = None,
) -> list[GpuFit]:
    """Judge the traced step on every catalog card; for a card it does not fit, the first
    of ``options`` (levers in the standard order, then combinations) that fits it."""
    rows = []
    for gpu in gpus or catalog():
        estimate = bench.on(recipe, gpu)
        row = GpuFit(
            gpu.name, gpu.total_bytes, estimate.verdict.status, estimate.peak.device_total_bytes
        )
        if row.status != "fits":
            for option in options:
                changed = bench.on(recipe.with_changes(**option.changes), gpu)
                if changed.verdict.status == "fits":
                    row = GpuFit(
                        gpu.name,
                        gpu.total_bytes,
                        row.status,
                        row.device_total_bytes,
                        option.name,
                        option.flags,
                    )
                    break
        rows.append(row)
    return rows
