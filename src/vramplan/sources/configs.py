"""Hugging Face configs as plain dictionaries, found where a user's model ids point: a
local ``config.json``, the Hub's cache, the Hub itself (config files only) or the bundled
catalog. Neither torch nor transformers is imported, so ``vramplan llm`` and
``vramplan models hf`` answer without them::

    >>> load_config_dict("gpt2")[1]["n_layer"]
    12
    >>> load_config_dict("meta-llama/Llama-3.2-3B")[1]["num_hidden_layers"]
    28
    >>> "meta-llama/Meta-Llama-3-8B" in bundled_configs()
    True
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vramplan.errors import UserError
from vramplan.sources.catalog import catalog_entries, close_matches, entry_config, find_entry
from vramplan.sources.hub import (
    HubId,
    cache_root,
    cached_config,
    download_config,
    hub_offline,
    parse_hub_id,
)


def bundled_configs() -> list[str]:
    """Hub ids of the configs shipped with vramplan."""
    return [entry.hub_id for entry in catalog_entries()]


def _read_config(path: Path, label: str | None = None) -> tuple[str, dict[str, Any]]:
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise UserError(f"malformed config JSON in {path}: {exc}") from None
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not isinstance(config, dict):
        raise UserError(f"malformed config JSON in {path}: expected an object")
    return label or str(path), config


def load_config_dict(name: str) -> tuple[str, dict[str, Any]]:
    """The config a name points to and a label for it, looked for in order: a path to a
    config.json (or its folder); for a hub id ``ORG/NAME[@REVISION]`` the Hub's cache
    (``HF_HUB_CACHE``, ``HF_HOME``), then the Hub when online and ``HF_HUB_OFFLINE`` is not
    set; then the bundled catalog (hub ids, repository names, short aliases), which also
    answers for a bundled model the Hub refuses (gated, and the user not logged in)."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(
                f"folder {path} has no config.json (hf:FOLDER reads FOLDER/config.json)"
            )
        return _read_config(path / "config.json")
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise UserError(f"config file not found: {path}")
        return _read_config(path)
    hub_id = parse_hub_id(name)
    entry = find_entry(hub_id.repo if hub_id else name)
    if hub_id is not None and hub_id.revision not in (None, "main"):
        entry = None  # the catalog holds main's config only
    if hub_id is not None:
        found = cached_config(hub_id)
        try:
            found = found or download_config(hub_id)
        except UserError:  # gated, private or gone: the bundled copy answers, if there is one
            if entry is None:
                raise
        if found is not None:
            return _read_config(found, hub_id.label)
    if entry is not None:
        return entry.hub_id, entry_config(entry)
    if hub_id is None and "/" not in name and ":" not in name and name.strip():
        found = cached_config(HubId(name.strip()))  # the Hub's old ids without an org
        if found is not None:
            return _read_config(found, name.strip())
    raise UserError(_unknown(name, hub_id))


def _unknown(name: str, hub_id: HubId | None) -> str:
    close = close_matches(hub_id.repo if hub_id else name)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    hub = "HF_HUB_OFFLINE is set" if hub_offline() else "the Hub was not reached"
    where = (
        f"not in the Hugging Face cache ({cache_root()}), {hub}, and not bundled"
        if hub_id
        else "not bundled (a hub id is ORG/NAME)"
    )
    return (
        f"unknown hf model {name!r}: {where}{hint} "
        "(`vramplan models --search TEXT` searches the bundled ones; or give a path to a "
        "config.json)"
    )


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
_MAY_BE_ZERO = {"type_vocab_size"}  # DeBERTa-v3 has no token types
_MAX_SIZE = 2**31 - 1
_MAX_LAYERS = 1000


def _present(data: dict[str, Any], keys: tuple[str, ...]) -> str | None:
    return next((k for k in keys if data.get(k) is not None), None)


def validate_config(label: str, data: dict[str, Any]) -> None:
    """Refuse a config whose sizes make no model, naming the field, before anything is
    built (transformers would divide by zero, or build its default model for the fields a
    config leaves out: a config with only ``model_type: llama`` is a 6.7B model). A
    composite model (LLaVA, CLIP, Gemma 3) gives its sizes in ``text_config`` and
    ``vision_config``::

        >>> validate_config("c.json", {"model_type": "gpt2", "n_embd": 0})
        Traceback (most recent call last):
        vramplan.errors.UserError: config c.json: n_embd must be a positive integer, got 0
    """
    model_type = data.get("model_type")
    if not model_type:
        raise UserError(f"config {label} has no model_type")
    if not isinstance(model_type, str):
        raise UserError(f"config {label}: model_type must be a string, got {model_type!r}")
    _check_fields(label, data)
    parts = {k: data[k] for k in _SUB_CONFIGS if isinstance(data.get(k), dict)}
    for key, part in parts.items():
        _check_fields(f"{label} {key}", part)
    if _present(data, WIDTH_KEYS) or _present(data, LAYER_KEYS) or not parts:
        _check_sizes(label, data)
    elif not any(_check_sizes(f"{label} {k}", p, required=False) for k, p in parts.items()):
        _check_sizes(label, data)  # raises: no part gives a size either
    architectures = data.get("architectures")
    if architectures is not None and (
        not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures)
    ):
        raise UserError(f"config {label}: architectures must be a list of class names")


_SUB_CONFIGS = ("text_config", "vision_config", "audio_config")


def _check_fields(label: str, data: dict[str, Any]) -> None:
    for key in _POSITIVE_INTS:
        if key not in data or (data[key] is None and key in _NULLABLE):
            continue
        value, least = data[key], 0 if key in _MAY_BE_ZERO else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise UserError(f"config {label}: {key} must be a positive integer, got {value!r}")
        if value > _MAX_SIZE:
            raise UserError(f"config {label}: {key} {value:,} is larger than any model's")
    for key, value in data.items():
        if ("dropout" in key or key.endswith("pdrop")) and "fusion" not in key:
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UserError(f"config {label}: {key} must be a number, got {value!r}")
            if not 0 <= value < 1:
                raise UserError(f"config {label}: {key} must be in [0, 1), got {value!r}")


def _check_sizes(label: str, data: dict[str, Any], required: bool = True) -> bool:
    """Whether ``data`` gives a width and a depth that agree with its heads; a UserError
    when it gives them wrong, or (``required``) not at all."""
    width, layers = _present(data, WIDTH_KEYS), _present(data, LAYER_KEYS)
    if width is None or layers is None:
        if not required:
            return False
        missing = " or ".join(WIDTH_KEYS[:3] if width is None else LAYER_KEYS[:3])
        raise UserError(
            f"config {label} does not give the model's size ({missing} is missing); "
            "vramplan does not fill in a library default: give the full config.json"
        )
    if data[layers] > _MAX_LAYERS:
        raise UserError(f"config {label}: {layers} {data[layers]:,} is more than {_MAX_LAYERS}")
    heads = _present(data, HEAD_KEYS)
    per_head = "head_dim" in data or "d_kv" in data  # heads need not divide the width
    if heads is not None and not per_head and data[width] % data[heads]:
        raise UserError(
            f"config {label}: {heads} {data[heads]} does not divide {width} {data[width]}"
        )
    kv = data.get("num_key_value_heads")
    if heads is not None and kv is not None and data[heads] % kv:
        raise UserError(
            f"config {label}: num_key_value_heads {kv} does not divide {heads} {data[heads]}"
        )
    return True
