"""Read a training config file into a plain mapping: JSON, YAML or TOML, by extension.

A malformed file is one line (a UserError), never a traceback::

    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "ds.json"
    >>> _ = path.write_text('{"train_micro_batch_size_per_gpu": 4}')
    >>> load_mapping(path)
    {'train_micro_batch_size_per_gpu': 4}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vramplan.errors import UserError

SUFFIXES = {".json": "JSON", ".yaml": "YAML", ".yml": "YAML", ".toml": "TOML"}


def _parse(text: str, kind: str) -> Any:
    if kind == "JSON":
        return json.loads(text)
    if kind == "YAML":
        import yaml

        return yaml.safe_load(text)
    try:
        import tomllib
    except ImportError:  # Python 3.10
        raise UserError("reading a TOML config needs Python 3.11 or later (tomllib)") from None
    return tomllib.loads(text)


def load_mapping(path: str | Path) -> dict[str, Any]:
    """The file's top-level mapping (a UserError when missing, unreadable or malformed)."""
    file = Path(path).expanduser()
    kind = SUFFIXES.get(file.suffix.lower())
    if kind is None:
        raise UserError(
            f"config {file}: give a .json (DeepSpeed), .yaml/.yml (accelerate, torchtune, "
            "axolotl) or .toml (torchtitan) file"
        )
    if not file.is_file():
        raise UserError(f"config file not found: {file}")
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read config {file}: {exc}") from None
    try:
        data = _parse(text, kind)
    except UserError:
        raise
    except Exception as exc:  # json, yaml and tomllib raise their own error types
        reason = " ".join(str(exc).split())
        raise UserError(f"malformed {kind} in {file}: {reason}") from None
    if not isinstance(data, dict):
        raise UserError(f"malformed config {file}: expected a mapping at the top level")
    return data
