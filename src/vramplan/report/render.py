"""Print an Estimate as the terminal table or the JSON contract, and pick the exit code::

code = emit(est, json_output=True, units="binary")   # prints the JSON; 0 when it fits
"""

from __future__ import annotations

import json
import sys

from vramplan.errors import UserError
from vramplan.report.terminal import render_estimate
from vramplan.result import Estimate

UNITS = ("binary", "decimal")


def check_units(units: str) -> str:
    if units not in UNITS:
        raise UserError(f"unknown units {units!r}; choose binary or decimal")
    return units


def print_json(data: object) -> None:
    """One JSON document on stdout."""
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


def emit(estimate: Estimate, *, json_output: bool, units: str) -> int:
    """Render to stdout; return 3 when the verdict is OOM, else 0."""
    check_units(units)
    if json_output:
        print_json(estimate.to_json())
    else:
        render_estimate(estimate, units)
    return 3 if estimate.verdict is not None and estimate.verdict.status == "oom" else 0
