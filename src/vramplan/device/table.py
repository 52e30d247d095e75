"""The bundled runtime figures (``data/runtime.json``), each with its source.

>>> runtime_table()["cublas_workspace"]["sm90_bytes"]
33554432
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources


@cache
def runtime_table() -> dict:
    """The bundled runtime figures with their sources."""
    return json.loads((resources.files("vramplan") / "data" / "runtime.json").read_text())
