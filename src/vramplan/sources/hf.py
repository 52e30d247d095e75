"""``hf:NAME``: Hugging Face transformers models from bundled configs or a local config.json.

No weights and no network: the config is a bundled data file (or the user's own file),
and the model is built on the meta device::

    >>> built = build_hf("gpt2", Recipe(batch_size=2, seq_len=128))
    >>> built.kind
    'causal-lm'
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vramplan.errors import UserError
from vramplan.recipe import Recipe
from vramplan.sources.base import Batch, BuiltModel
from vramplan.sources.blocks import checkpoint_options, chosen_blocks
from vramplan.sources.configs import WIDTH_KEYS, load_config_dict, validate_config
from vramplan.sources.generation import Generator, ImagePrompt, generator_for
from vramplan.sources.hf_attention import (
    NOTES,
    REGISTERED,
    attention_name,
    check_attention,
    repeated_kv,
)
from vramplan.sources.hf_attention import register as register_attention
from vramplan.sources.hf_inputs import (
    EMBEDDING_NOTE,
    ENCODER_DECODER,
    example_inputs,
    image_shape,
    image_tokens,
    learned_positions,
    model_kind,
    one_sequence_per_row,
    value_checks_off,
)
from vramplan.sources.hf_moe import experts_name, is_moe, moe_note
from vramplan.sources.hf_moe import register as register_experts
from vramplan.sources.hf_moe_linear import use_linear_experts
from vramplan.sources.hub import parse_hub_id
from vramplan.trace.patching import patched


def _transformers():
    try:
        import transformers
    except ImportError:
        raise UserError("transformers is not installed: pip install 'vramplan[hf]'") from None
    transformers.logging.set_verbosity_error()
    return transformers


_CLASSIFIERS = ("ForImageClassification", "ForSequenceClassification")


def _validate(name: str, data: dict[str, Any]) -> None:
    """A composite config (CLIP, LLaVA: sizes only in ``text_config``/``vision_config``)
    is validated part by part."""
    parts = {k: v for k, v in data.items() if k.endswith("_config") and isinstance(v, dict)}
    if not parts or any(key in data for key in WIDTH_KEYS):
        validate_config(name, data)
        return
    if not isinstance(data.get("model_type"), str):
        raise UserError(f"config {name} has no model_type")
    for key, part in parts.items():
        validate_config(f"{name} {key}", {"model_type": data["model_type"], **part})


def _make_config(transformers, name: str, data: dict[str, Any]):
    _validate(name, data)
    model_type = data["model_type"]
    try:
        config_class = transformers.CONFIG_MAPPING[model_type]
    except KeyError:
        ships = " ships its own modeling code (auto_map) and" if data.get("auto_map") else ""
        raise UserError(
            f"config {name}{ships}: model_type {model_type!r} is not in transformers "
            f"{transformers.__version__}; vramplan runs no code from a model repository "
            "unless you pass --trust-remote-code"
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


def _remote_model(transformers, label: str, data: dict[str, Any], device: str) -> nn.Module:
    """The model a repository's own code builds (``auto_map``), asked for with
    ``trust_remote_code``: transformers fetches the config and code files, never weights."""
    validate_config(label, data)
    hub_id = parse_hub_id(label)
    where, revision = (hub_id.repo, hub_id.revision) if hub_id else (str(Path(label).parent), None)
    auto = next(
        (a for a in _REMOTE_HEADS if a in data["auto_map"]),
        "AutoModel",
    )
    try:
        config = transformers.AutoConfig.from_pretrained(
            where, revision=revision, trust_remote_code=True
        )
        with torch.device(device):
            return getattr(transformers, auto).from_config(config, trust_remote_code=True)
    except Exception as exc:  # the repository's code is the user's to vouch for
        reason = " ".join(str(exc).split())
        raise UserError(f"cannot build {label} with its own code: {reason}") from None


_REMOTE_HEADS = ("AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModelForSeq2SeqLM")


def _local_model(
    transformers, label: str, data: dict[str, Any], device: str, recipe: Recipe
) -> nn.Module:
    config = _make_config(transformers, label, data)
    model_class = _model_class(transformers, config, label)
    if recipe.num_classes is not None:
        if not model_class.__name__.endswith(_CLASSIFIERS):
            raise UserError(f"--num-classes: {model_class.__name__} has no classification head")
        config.num_labels = recipe.num_classes
    # transformers' own choice: SDPA where the model supports it (Gemma 2 does not: eager)
    default_attention = "sdpa" if getattr(model_class, "_supports_sdpa", True) else "eager"
    attention = recipe.attention or data.get("attn_implementation", default_attention)
    if recipe.attention is not None:
        check_attention(attention, model_class, recipe, f"hf:{label}")
    if attention in REGISTERED:
        register_attention(transformers)
    implementations = {"attn_implementation": attention_name(attention)}
    if recipe.experts is not None:
        if not is_moe(config):
            raise UserError(f"--experts {recipe.experts}: hf:{label} has no mixture of experts")
        register_experts(transformers)
        implementations["experts_implementation"] = experts_name(recipe)
    try:
        with torch.device(device):
            model = model_class._from_config(config, **implementations)
    except Exception as exc:  # a config transformers accepts but cannot build
        reason = " ".join(str(exc).split())
        raise UserError(f"cannot build {model_class.__name__} from {label}: {reason}") from None
    if recipe.experts == "linear":
        use_linear_experts(model, recipe.moe_routing)
    return model


def unscripted() -> contextlib.AbstractContextManager:
    """``@torch.jit.script`` leaves functions as Python while a modeling module is first
    imported: TorchScript runs no fake tensors, and transformers before 5.2x scripted
    DeBERTa-v2's relative-position helpers (``make_log_bucket_position``), so tracing
    failed "in the TorchScript interpreter". The functions compute the same in Python.

    >>> with unscripted():
    ...     f = torch.jit.script(lambda x: x + 1)
    >>> f(1)
    2
    """
    return patched([(torch.jit, "script", lambda obj, *args, **kwargs: obj)])


def build_hf(
    name: str, recipe: Recipe, device: str = "meta", trust_remote_code: bool = False
) -> BuiltModel:
    """A transformers model on the meta device with a batch that fits its head; a
    repository's own modeling code runs only with ``trust_remote_code``."""
    transformers = _transformers()
    label, data = load_config_dict(name)
    remote = (
        trust_remote_code
        and isinstance(data.get("auto_map"), dict)
        and data.get("model_type") not in transformers.CONFIG_MAPPING
    )
    with unscripted():  # the modeling module is imported here, on first use
        if remote:
            model = _remote_model(transformers, label, data, device)
        else:
            model = _local_model(transformers, label, data, device, recipe)
    # Hub configs carry the checkpoint's dtype (``torch_dtype: bfloat16``), which
    # transformers builds in; the recipe's precision decides, from fp32 weights.
    return wrap_hf_model(model.float(), recipe, f"hf:{label}")


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (transformers not imported
    when it was not already)."""
    import sys

    transformers = sys.modules.get("transformers")
    pretrained = getattr(transformers, "PreTrainedModel", None) if transformers else None
    return pretrained is not None and isinstance(model, pretrained)


def wrap_hf_model(model: nn.Module, recipe: Recipe, built_name: str) -> BuiltModel:
    """A transformers model (a built one, or the user's own, on the meta device) with a
    batch built from its config, its loss as transformers computes it, and transformers'
    own gradient checkpointing."""
    config = model.config
    kind = model_kind(model)
    inputs = example_inputs(model, kind, recipe, built_name)

    @contextlib.contextmanager
    def forward_context() -> Iterator[None]:
        checks = contextlib.nullcontext() if inputs.value_checks else value_checks_off()
        with checks, one_sequence_per_row():
            yield

    def run(module: nn.Module, batch: Batch, training: bool):
        with forward_context():
            if training and kind == "embedding":
                return in_batch_contrastive(module(**batch))
            if training:
                return module(**batch, **inputs.loss_kwargs).loss
            keep_labels = kind in ENCODER_DECODER  # the decoder reads them
            return module(**{k: v for k, v in batch.items() if k != "labels" or keep_labels})

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
        make_batch=inputs.make_batch,
        run=run,
        forward_context=forward_context,
        step_context=repeated_kv if recipe.repeat_kv else contextlib.nullcontext,
        default_input_shape=inputs.shape,
        enable_checkpointing=enable_checkpointing
        if model.supports_gradient_checkpointing
        else None,
        blocks=len(checkpoint_layers(model)) if model.supports_gradient_checkpointing else 0,
        sequence=inputs.sequence,
        notes=inputs.notes
        + ([EMBEDDING_NOTE.format(arch=type(model).__name__)] if kind == "embedding" else [])
        + _notes(config, recipe, inputs.shape),
        generator=_generator(model, kind, recipe),
    )


def in_batch_contrastive(output) -> torch.Tensor:
    """sentence-transformers' MultipleNegativesRankingLoss on one pass: the pooled
    embeddings (the pooler's output, else the mean over tokens), their (batch, batch)
    similarity scores, and cross-entropy against each sample's own column.

    >>> from types import SimpleNamespace
    >>> out = SimpleNamespace(pooler_output=None, last_hidden_state=torch.zeros(4, 3, 8))
    >>> in_batch_contrastive(out).shape
    torch.Size([])
    """
    pooled = getattr(output, "pooler_output", None)
    if pooled is None:
        pooled = output.last_hidden_state.mean(dim=1)
    scores = pooled @ pooled.transpose(0, 1)
    labels = torch.arange(scores.size(0), device=scores.device)
    return torch.nn.functional.cross_entropy(scores.float(), labels)


def _generator(model: nn.Module, kind: str, recipe: Recipe) -> Generator | None:
    """How generate runs ``model``: a causal LM, an encoder-decoder one, or a LLaVA-style
    one with one image's tokens in each prompt (None: not a model generate runs)."""
    config = model.config
    if kind in ("causal-lm", *ENCODER_DECODER):
        return generator_for(model, config, learned_positions(config))
    if kind == "vision-language":
        pixels = image_shape(config.vision_config, recipe)
        image = ImagePrompt(image_tokens(config), int(config.image_token_id), pixels)
        return generator_for(model, config, None, image)
    return None


def _notes(config, recipe: Recipe, shape: tuple[int, ...]) -> list[str]:
    """What the build chose that the reader should know: attention, expert routing."""
    notes = [NOTES[recipe.attention]] if recipe.attention else []
    if is_moe(config):
        notes.append(moe_note(config, recipe, recipe.batch_size * shape[0]))
    return notes
