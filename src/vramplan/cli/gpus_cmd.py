"""``vramplan gpus``: the GPU catalog.

$ vramplan gpus
"""

from __future__ import annotations

import vramplan
from vramplan.cli.app import app
from vramplan.cli.options import JsonOpt, UnitsOpt
from vramplan.report.catalog import gpus_json, render_gpus
from vramplan.report.render import check_units, print_json


@app.command("gpus")
def gpus_command(json_output: JsonOpt = False, units: UnitsOpt = "binary") -> int:
    """List the catalog GPUs with their memory and architecture."""
    check_units(units)
    if json_output:
        print_json(gpus_json(vramplan.gpus()))
    else:
        render_gpus(vramplan.gpus(), units)
    return 0
