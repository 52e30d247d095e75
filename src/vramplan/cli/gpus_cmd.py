"""``vramplan gpus``: the GPU catalog.

$ vramplan gpus
"""

from __future__ import annotations

import json
import sys

from rich.console import Console
from rich.table import Table

from vramplan.cli import app
from vramplan.cli.options import JsonOpt, UnitsOpt
from vramplan.gpus import catalog
from vramplan.report.render import check_units
from vramplan.units import format_bytes


@app.command("gpus")
def gpus_command(json_output: JsonOpt = False, units: UnitsOpt = "binary") -> int:
    """List the catalog GPUs with their memory and architecture."""
    check_units(units)
    if json_output:
        json.dump(
            [gpu.to_json() | {"aliases": list(gpu.aliases)} for gpu in catalog()],
            sys.stdout,
            indent=2,
        )
        sys.stdout.write("\n")
        return 0
    table = Table(title="GPU catalog (total memory as the device reports it)")
    for column in ("name", "memory", "bytes", "arch", "spellings"):
        table.add_column(column, justify="right" if column in ("memory", "bytes") else "left")
    for gpu in catalog():
        table.add_row(
            gpu.name,
            format_bytes(gpu.total_bytes, units),
            f"{gpu.total_bytes:,}",
            f"{gpu.arch} ({gpu.family})",
            ", ".join(gpu.aliases),
        )
    Console().print(table)
    return 0
