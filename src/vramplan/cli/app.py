"""The typer application every command module registers itself on.

from vramplan.cli.app import app

@app.command("gpus")
def gpus_command() -> int: ...
"""

from __future__ import annotations

import typer

app = typer.Typer(
    name="vramplan",
    help="Predict the GPU memory of a training or inference step before you launch it.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def _root() -> None:
    """Predict the GPU memory of a training or inference step before you launch it."""
