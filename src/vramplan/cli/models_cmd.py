"""``vramplan models``: the model names each source accepts.

$ vramplan models hf
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from vramplan.cli import app
from vramplan.errors import UserError

SOURCES = ("hf", "torchvision", "timm")


def names_for(source: str) -> list[str]:
    """Names ``source:NAME`` accepts (bundled configs for hf)."""
    if source == "hf":
        from vramplan.sources.hf import bundled_configs

        return bundled_configs()
    if source == "torchvision":
        from vramplan.sources.vision import require_package

        torchvision = require_package("torchvision", "vision")
        return sorted(
            torchvision.models.list_models(module=torchvision.models)
            + torchvision.models.list_models(module=torchvision.models.segmentation)
        )
    if source == "timm":
        from vramplan.sources.vision import require_package

        return sorted(require_package("timm", "timm").list_models())
    raise UserError(f"unknown source {source!r}; choose one of: {', '.join(SOURCES)}")


@app.command("models")
def models_command(
    source: Annotated[str, typer.Argument(help="hf | torchvision | timm")] = "hf",
    json_output: Annotated[bool, typer.Option("--json", help="Print a JSON list.")] = False,
) -> int:
    """List the model names a source accepts (hf: the bundled configs)."""
    names = names_for(source)
    if json_output:
        json.dump(names, sys.stdout)
        sys.stdout.write("\n")
    else:
        for name in names:
            print(f"{source}:{name}")
    return 0
