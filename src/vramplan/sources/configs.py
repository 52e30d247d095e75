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
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(
                f"folder {path} has no config.json (hf:FOLDER reads FOLDER/config.json)"
            )
        path = path / "config.json"
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise UserError(f"config file not found: {path}")
        try:
            config = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise UserError(f"malformed config JSON in {path}: {exc}") from None
        except OSError as exc:
            raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
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


# The config fields that size a model, under the names model families use for them.
WIDTH_KEYS = ("hidden_size", "n_embd", "d_model", "dim")
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
# Fields that must be positive integers when present; ``null`` means "the default" for
# the ones in _NULLABLE (n_inner: 4·hidden, num_key_value_heads: one per head, ...).
_POSITIVE_INTS = (
    *WIDTH_KEYS,
    *LAYER_KEYS,
    *HEAD_KEYS,
    "num_key_value_heads",
    "intermediate_size",
    "n_inner",
    "d_ff",
    "d_kv",
    "head_dim",
    "vocab_size",
    "n_positions",
    "n_ctx",
    "max_position_embeddings",
    "image_size",
    "patch_size",
    "num_channels",
    "num_labels",
    "num_local_experts",
    "num_experts_per_tok",
    "num_decoder_layers",
    "type_vocab_size",
)
_NULLABLE = {"n_inner", "num_key_value_heads", "head_dim", "num_decoder_layers", "d_ff"}
_MAX_SIZE = 2**31 - 1
_MAX_LAYERS = 1000


def _present(data: dict[str, Any], keys: tuple[str, ...]) -> str | None:
    return next((k for k in keys if data.get(k) is not None), None)


def validate_config(label: str, data: dict[str, Any]) -> None:
    """Refuse a config whose sizes make no model, naming the field, before anything is
    built (transformers would divide by zero, or build its default model for the fields a
    config leaves out: a config with only ``model_type: llama`` is a 6.7B model)::

        >>> validate_config("c.json", {"model_type": "gpt2", "n_embd": 0})
        Traceback (most recent call last):
        vramplan.errors.UserError: config c.json: n_embd must be a positive integer, got 0
    """
    model_type = data.get("model_type")
    if not model_type:
        raise UserError(f"config {label} has no model_type")
    if not isinstance(model_type, str):
        raise UserError(f"config {label}: model_type must be a string, got {model_type!r}")
    for key in _POSITIVE_INTS:
        if key not in data or (data[key] is None and key in _NULLABLE):
            continue
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise UserError(f"config {label}: {key} must be a positive integer, got {value!r}")
        if value > _MAX_SIZE:
            raise UserError(f"config {label}: {key} {value:,} is larger than any model's")
    for key, value in data.items():
        if ("dropout" in key or key.endswith("pdrop")) and value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UserError(f"config {label}: {key} must be a number, got {value!r}")
            if not 0 <= value < 1:
                raise UserError(f"config {label}: {key} must be in [0, 1), got {value!r}")
    width, layers = _present(data, WIDTH_KEYS), _present(data, LAYER_KEYS)
    if width is None or layers is None:
        missing = " or ".join(WIDTH_KEYS[:3] if width is None else LAYER_KEYS[:3])
        raise UserError(
            f"config {label} does not give the model's size ({missing} is missing); "
            "vramplan does not fill in a library default: give the full config.json"
        )
    if data[layers] > _MAX_LAYERS:
        raise UserError(f"config {label}: {layers} {data[layers]:,} is more than {_MAX_LAYERS}")
    heads = _present(data, HEAD_KEYS)
    if heads is not None and "head_dim" not in data and data[width] % data[heads]:
        raise UserError(
            f"config {label}: {heads} {data[heads]} does not divide {width} {data[width]}"
        )
    kv = data.get("num_key_value_heads")
    if heads is not None and kv is not None and data[heads] % kv:
        raise UserError(
            f"config {label}: num_key_value_heads {kv} does not divide {heads} {data[heads]}"
        )
    architectures = data.get("architectures")
    if architectures is not None and (
        not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures)
    ):
        raise UserError(f"config {label}: architectures must be a list of class names")
