"""``hf:NAME``: Hugging Face transformers models from bundled configs or a local config.json.

No weights and no network: the config is a bundled data file (or the user's own file),
and the model is built on the meta device::

    >>> built = build_hf("gpt2", Recipe(batch_size=2, seq_len=128))
    >>> built.kind
    'causal-lm'
"""

from __future__ import annotations

import difflib
import json
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vramplan.errors import UserError
from vramplan.recipe import Recipe
from vramplan.sources.base import Batch, BuiltModel

DEFAULT_SEQ_LEN = 512
DEFAULT_IMAGE_SIZE = 224
# Models whose positions are learned embeddings cannot run past their table.
_POSITION_KEYS = ("n_positions", "max_position_embeddings")
_ABSOLUTE_POSITIONS = {"gpt2", "bert", "roberta", "vit", "gpt_neo", "opt", "distilbert"}
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


def _transformers():
    try:
        import transformers
    except ImportError:
        raise UserError("transformers is not installed: pip install 'vramplan[hf]'") from None
    transformers.logging.set_verbosity_error()
    return transformers


def _make_config(transformers, name: str, data: dict[str, Any]):
    validate_config(name, data)
    model_type = data["model_type"]
    try:
        config_class = transformers.CONFIG_MAPPING[model_type]
    except KeyError:
        raise UserError(
            f"config {name}: model_type {model_type!r} is not in transformers "
            f"{transformers.__version__} (custom code is not run: trust_remote_code stays off)"
        ) from None
    fields = {
        k: v
        for k, v in data.items()
        if k not in ("model_type", "transformers_version", "attn_implementation")
    }
    try:
        return config_class(**fields)
    except Exception as exc:  # transformers 5's strict-dataclass errors are their own class
        reason = " ".join(str(exc).split())
        raise UserError(f"config {name} is not a valid {model_type} config: {reason}") from None


def full_config(label: str, data: dict[str, Any]) -> dict[str, Any]:
    """The config as ``estimate`` reads it: validated, with transformers' defaults filled in
    for the fields it leaves out (when transformers is installed), so ``llm`` and
    ``estimate`` accept the same configs and read the same sizes."""
    validate_config(label, data)
    try:
        import transformers  # noqa: F401
    except ImportError:
        return dict(data)
    config = _make_config(_transformers(), label, data)
    return {**config.to_dict(), **data}


def _model_class(transformers, config, name: str):
    architectures = getattr(config, "architectures", None) or []
    for arch in architectures:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    for auto in (
        "AutoModelForCausalLM",
        "AutoModelForMaskedLM",
        "AutoModelForSeq2SeqLM",
        "AutoModelForImageClassification",
    ):
        mapping = getattr(transformers, auto)._model_mapping
        if type(config) in mapping:
            return mapping[type(config)]
    raise UserError(f"config {name}: no trainable head for architectures {architectures}")


def _kind(model: nn.Module) -> str:
    arch = type(model).__name__
    if arch.endswith("ForCausalLM") or arch.endswith("LMHeadModel"):
        return "causal-lm"
    if arch.endswith("ForConditionalGeneration") and getattr(
        model.config, "is_encoder_decoder", False
    ):
        return "seq2seq"
    if arch.endswith("ForMaskedLM"):
        return "masked-lm"
    if arch.endswith("ForImageClassification"):
        return "image-classification"
    if arch.endswith("ForSequenceClassification"):
        return "sequence-classification"
    raise UserError(f"hf model architecture {arch} is not supported yet")


def _max_positions(config) -> int | None:
    for key in _POSITION_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value - (2 if config.model_type == "roberta" else 0)
    return None


def _seq_len(config, recipe: Recipe, label: str) -> int:
    limit = _max_positions(config)
    seq_len = recipe.seq_len
    if seq_len is None and recipe.input_shape:
        if len(recipe.input_shape) != 1:
            raise UserError(
                f"text models take --seq-len (or --input-shape S), got {recipe.input_shape}"
            )
        seq_len = recipe.input_shape[0]
    if seq_len is None:
        seq_len = min(DEFAULT_SEQ_LEN, limit or DEFAULT_SEQ_LEN)
    if limit is not None and config.model_type in _ABSOLUTE_POSITIONS and seq_len > limit:
        raise UserError(f"{label} has {limit} learned positions; --seq-len {seq_len} is longer")
    return seq_len


def checkpoint_layers(model: nn.Module) -> list[nn.Module]:
    """The layers transformers can recompute, in forward order."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers < 4.52: layers carry the flag themselves
        return [
            m
            for m in model.modules()
            if hasattr(m, "gradient_checkpointing")
            and not any(
                True for c in m.modules() if c is not m and hasattr(c, "gradient_checkpointing")
            )
        ]
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def build_hf(name: str, recipe: Recipe, device: str = "meta") -> BuiltModel:
    """A transformers model on the meta device with a batch that fits its head."""
    transformers = _transformers()
    label, data = load_config_dict(name)
    config = _make_config(transformers, label, data)
    model_class = _model_class(transformers, config, label)
    try:
        with torch.device(device):
            model = model_class._from_config(
                config, attn_implementation=data.get("attn_implementation", "sdpa")
            )
    except Exception as exc:  # a config transformers accepts but cannot build
        reason = " ".join(str(exc).split())
        raise UserError(f"cannot build {model_class.__name__} from {label}: {reason}") from None
    kind = _kind(model)
    vocab = getattr(config, "vocab_size", None)
    built_name = f"hf:{label}"

    if kind == "image-classification":
        size = getattr(config, "image_size", DEFAULT_IMAGE_SIZE)
        shape = recipe.input_shape or (getattr(config, "num_channels", 3), size, size)
        classes = config.num_labels

        def make_batch(batch_size: int, dtype: torch.dtype) -> Batch:
            return {
                "pixel_values": torch.randn(batch_size, *shape, dtype=dtype),
                "labels": torch.randint(0, classes, (batch_size,)),
            }
    else:
        seq_len = _seq_len(config, recipe, built_name)
        shape = (seq_len,)

        def make_batch(batch_size: int, dtype: torch.dtype) -> Batch:
            ids = torch.randint(0, vocab, (batch_size, seq_len))
            batch = {"input_ids": ids}
            if kind == "sequence-classification":
                batch["labels"] = torch.randint(0, config.num_labels, (batch_size,))
            else:
                batch["labels"] = ids
            return batch

    def run(module: nn.Module, batch: Batch, training: bool):
        if training:
            return module(**batch).loss
        inputs = {k: v for k, v in batch.items() if k != "labels" or kind == "seq2seq"}
        return module(**inputs)

    def enable_checkpointing(module: nn.Module, limit: int | None) -> int:
        non_reentrant = {"use_reentrant": False}
        if hasattr(module, "activation_checkpointing_enable"):  # transformers >= 5
            module.activation_checkpointing_enable(activation_checkpointing_kwargs=non_reentrant)
        else:
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=non_reentrant)
        layers = checkpoint_layers(module)
        if limit is not None:  # selective: only the first ``limit`` layers recompute
            for layer in layers[limit:]:
                layer.gradient_checkpointing = False
        return len(layers)

    return BuiltModel(
        name=built_name,
        architecture=type(model).__name__,
        kind=kind,
        model=model,
        make_batch=make_batch,
        run=run,
        default_input_shape=shape,
        enable_checkpointing=enable_checkpointing
        if model.supports_gradient_checkpointing
        else None,
        blocks=len(checkpoint_layers(model)) if model.supports_gradient_checkpointing else 0,
        sequence=kind != "image-classification",
    )
