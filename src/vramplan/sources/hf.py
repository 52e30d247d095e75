"""``hf:NAME``: Hugging Face transformers models from bundled configs or a local config.json.

No weights and no network: the config is a bundled data file (or the user's own file),
and the model is built on the meta device::

    >>> built = build_hf("gpt2", Recipe(batch_size=2, seq_len=128))
    >>> built.kind
    'causal-lm'
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vramplan.errors import UserError
from vramplan.recipe import Recipe
from vramplan.sources.base import Batch, BuiltModel
from vramplan.sources.blocks import checkpoint_options, chosen_blocks
from vramplan.sources.configs import load_config_dict, validate_config

DEFAULT_SEQ_LEN = 512
DEFAULT_IMAGE_SIZE = 224
# Models whose positions are learned embeddings cannot run past their table.
_POSITION_KEYS = ("n_positions", "max_position_embeddings")
_ABSOLUTE_POSITIONS = {"gpt2", "bert", "roberta", "vit", "gpt_neo", "opt", "distilbert"}


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
    return wrap_hf_model(model, recipe, f"hf:{label}")


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (transformers not imported
    when it was not already)."""
    import sys

    transformers = sys.modules.get("transformers")
    pretrained = getattr(transformers, "PreTrainedModel", None) if transformers else None
    return pretrained is not None and isinstance(model, pretrained)


def wrap_hf_model(model: nn.Module, recipe: Recipe, built_name: str) -> BuiltModel:
    """A transformers model (a built one, or the user's own, on the meta device) with a
    batch that fits its head, its loss as transformers computes it, and transformers' own
    gradient checkpointing."""
    config = model.config
    kind = _kind(model)
    vocab = getattr(config, "vocab_size", None)

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

    def enable_checkpointing(
        module: nn.Module, limit: int | None, every: int = 1, ops: bool = False
    ) -> int:
        non_reentrant = checkpoint_options(ops)
        if hasattr(module, "activation_checkpointing_enable"):  # transformers >= 5
            module.activation_checkpointing_enable(activation_checkpointing_kwargs=non_reentrant)
        else:
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=non_reentrant)
        layers = checkpoint_layers(module)
        chosen = {id(layer) for layer in chosen_blocks(layers, limit, every)}
        for layer in layers:  # selective: only the chosen layers recompute
            if id(layer) not in chosen:
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
