"""``vramplan models``: the model names each source accepts, and a search through them.

$ vramplan models hf
$ vramplan models --search "llama 3.2"
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

import vramplan
from vramplan.cli.app import app
from vramplan.report.catalog import model_rows, render_models
from vramplan.report.render import print_json


@app.command("models")
def models_command(
    source: Annotated[
        str | None,
        typer.Argument(help="hf | torchvision | timm (default hf; every source with --search)"),
    ] = None,
    search: Annotated[
        str | None,
        typer.Option(
            "--search", help="Only models whose name (hub id, alias, family) holds every word."
        ),
    ] = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print a JSON list (rows with --search).")
    ] = False,
) -> int:
    """List the models a source accepts (hf: the bundled configs, with their published
    parameter count and licence); --search finds them by name."""
    if search is None:
        chosen = source or "hf"
        if json_output:
            print_json(vramplan.models(chosen))
            return 0
        matches = vramplan.find_models("", chosen)
    else:
        matches = vramplan.find_models(search, source)
        if json_output:
            print_json(model_rows(matches))
            return 0
    if not matches:
        print(
            f"no model matches {search!r}; `vramplan models hf` lists the bundled ones",
            file=sys.stderr,
        )
        return 1
    render_models(matches)
    return 0
