"""The GPU catalog and the model catalog as terminal tables, or as JSON rows.

render_gpus(vramplan.gpus(), "binary")
render_models(vramplan.find_models("qwen3"))
"""

from __future__ import annotations

from dataclasses import asdict

from rich.console import Console
from rich.table import Table

from vramplan.device.catalog import GpuSpec
from vramplan.quick import ModelMatch
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


def model_rows(matches: list[ModelMatch]) -> list[dict]:
    """Each model as a JSON row: name, family, licence, published parameters."""
    return [asdict(match) for match in matches]


def _count(match: ModelMatch) -> str:
    if match.params is None:
        return "-"
    if match.params_exact:
        return f"{match.params:,}"
    billions = match.params >= 10**9
    return f"~{match.params / (1e9 if billions else 1e6):g}{'B' if billions else 'M'}"


def render_models(matches: list[ModelMatch]) -> None:
    """One line per model; the bundled Hugging Face ones with their published parameter
    count (``~`` where the published figure is rounded), licence and family."""
    if not any(m.licence for m in matches):
        for match in matches:
            print(match.name)
        return
    width = max(len(m.name) for m in matches)
    print(f"{'model':<{width}}  {'parameters':>17}  {'licence':<26}  family")
    for match in matches:
        print(
            f"{match.name:<{width}}  {_count(match):>17}  {match.licence or '-':<26}  "
            f"{match.family or '-'}"
        )
