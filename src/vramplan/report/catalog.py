"""The GPU catalog as a terminal table, or as JSON rows.

render_gpus(vramplan.gpus(), "binary")
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from vramplan.device.catalog import GpuSpec
from vramplan.units import format_bytes


def gpus_json(cards: tuple[GpuSpec, ...]) -> list[dict]:
    """Each card's JSON with its accepted spellings."""
    return [gpu.to_json() | {"aliases": list(gpu.aliases)} for gpu in cards]


def render_gpus(cards: tuple[GpuSpec, ...], units: str) -> None:
    """Name, memory, architecture and spellings of each card."""
    table = Table(title="GPU catalog (total memory as the device reports it)")
    for column in ("name", "memory", "bytes", "arch", "spellings"):
        table.add_column(column, justify="right" if column in ("memory", "bytes") else "left")
    for gpu in cards:
        table.add_row(
            gpu.name,
            format_bytes(gpu.total_bytes, units),
            f"{gpu.total_bytes:,}",
            f"{gpu.arch} ({gpu.family})",
            ", ".join(gpu.aliases),
        )
    Console().print(table)
