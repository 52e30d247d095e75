"""``vramplan models``: the model names each source accepts.

$ vramplan models hf
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

import vramplan
from vramplan.cli.app import app


@app.command("models")
def models_command(
    source: Annotated[str, typer.Argument(help="hf | torchvision | timm | diffusers")] = "hf",
    json_output: Annotated[bool, typer.Option("--json", help="Print a JSON list.")] = False,
) -> int:
    """List the model names a source accepts (hf: the bundled configs)."""
    names = vramplan.models(source)
    if json_output:
        json.dump(names, sys.stdout)
        sys.stdout.write("\n")
    elif source == "torchvision":  # the tasks differ per model
        for name, task in vramplan.tasks(source).items():
            print(f"{source}:{name:<40} {task}")
    else:
        for name in names:
            print(f"{source}:{name}")
    return 0
