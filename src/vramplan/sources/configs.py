"""Hugging Face configs as plain dictionaries: the bundled ones and the user's own
``config.json``. Neither torch nor transformers is imported, so ``vramplan llm`` and
``vramplan models hf`` answer without them::

    >>> load_config_dict("gpt2")[1]["n_layer"]
    12
    >>> "meta-llama-3-8b" in bundled_configs()
    True
"""

from __future__ import annotations

import difflib
import json
from importlib import resources
from pathlib import Path
from typing import Any

from vramplan.errors import UserError

_PREFIXES = (
    "meta-llama/",
    "openai-community/",
    "google-bert/",
    "mistralai/",
    "qwen/",
    "google/",
    "facebookai/",
    "google-t5/",
    "tinyllama/",
)
_ALIASES = {
    "llama-3-8b": "meta-llama-3-8b",
    "llama-3-70b": "meta-llama-3-70b",
    "llama-2-7b-hf": "llama-2-7b",
    "mistral-7b": "mistral-7b-v0.1",
    "tinyllama-1.1b-chat-v1.0": "tinyllama-1.1b",
    "qwen2.5-7b-instruct": "qwen2.5-7b",
}


def bundled_configs() -> list[str]:
    """Names of the configs shipped with vramplan."""
    folder = resources.files("vramplan") / "data" / "hf"
    return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


def _canonical(name: str) -> str:
    key = name.strip().lower()
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            key = key[len(prefix) :]
    return _ALIASES.get(key, key)


def load_config_dict(name: str) -> tuple[str, dict[str, Any]]:
    """The config for a bundled name or a path to a config.json (or its folder)."""
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise UserError(f"config file not found: {path}")
        try:
            config = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"malformed config JSON in {path}: {exc}") from None
        if not isinstance(config, dict):
            raise UserError(f"malformed config JSON in {path}: expected an object")
        return str(path), config
    key = _canonical(name)
    known = bundled_configs()
    if key not in known:
        close = difflib.get_close_matches(key, known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; bundled: {', '.join(known)}"
        raise UserError(f"unknown hf model {name!r}{hint} (or give a path to a config.json)")
    text = (resources.files("vramplan") / "data" / "hf" / f"{key}.json").read_text()
    return key, json.loads(text)
