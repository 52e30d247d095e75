"""``vramplan calibrate``: measure this GPU's runtime and save a device profile.

$ vramplan calibrate
saved /root/.config/vramplan/profiles/a100-80gb.json
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

import vramplan
from vramplan.cli.app import app
from vramplan.cli.options import JsonOpt


@app.command("calibrate")
def calibrate_command(
    output: Annotated[
        str | None,
        typer.Option(
            "--output",
            help="Folder for the profile (default: $VRAMPLAN_PROFILE_DIR or "
            "~/.config/vramplan/profiles).",
        ),
    ] = None,
    json_output: JsonOpt = False,
) -> int:
    """Measure the CUDA context, loaded kernels and cuBLAS workspace of this GPU."""
    profile, path = vramplan.calibrate(output)
    if json_output:
        json.dump({**profile.to_json(), "path": str(path)}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(
            f"saved {path}: context {profile.cuda_context_bytes:,} B, cuBLAS workspace "
            f"{profile.cublas_workspace_bytes:,} B on {profile.gpu}"
        )
    return 0
