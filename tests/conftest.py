"""Shared fixtures: small models whose real CPU runs are the ground truth."""

from __future__ import annotations

import pytest
import torch

from vramplan.cli import main


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """Run ``vramplan ARGS`` in-process: (exit code, stdout, stderr)."""
    try:
        code = main(list(args))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)
