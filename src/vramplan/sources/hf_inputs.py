"""The example batch of a transformers model, built from its config: token ids for text
models, images of the config's size, Whisper's log-mel features, an encoder-decoder's
decoder length (``--target-len``), image and text together for CLIP/SigLIP and LLaVA::

    >>> import transformers
    >>> config = transformers.WhisperConfig(num_mel_bins=128, max_source_positions=1500)
    >>> speech_features(config)
    (128, 3000)
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vramplan.errors import UserError
from vramplan.recipe import Recipe
from vramplan.sources.base import Batch
from vramplan.trace.patching import patched

DEFAULT_SEQ_LEN = 512
DEFAULT_IMAGE_SIZE = 224
# Models whose positions are learned embeddings cannot run past their table.
_POSITION_KEYS = ("n_positions", "max_position_embeddings")
_ABSOLUTE_POSITIONS = {"gpt2", "bert", "roberta", "vit", "gpt_neo", "opt", "distilbert"}
# the kinds whose decoder reads the labels in inference too
ENCODER_DECODER = ("seq2seq", "speech-seq2seq")


@dataclass
class ExampleInputs:
    """How to make and feed one batch, and what the reader should know about it."""

    shape: tuple[int, ...]
    make_batch: Callable[[int, torch.dtype], Batch]
    sequence: bool
    notes: list[str] = field(default_factory=list)
    loss_kwargs: dict[str, Any] = field(default_factory=dict)
    value_checks: bool = True
    """False: transformers' ``torch_compilable_check``s on tensor values (which fake
    tensors do not have) are switched off while the model runs."""


@contextlib.contextmanager
def value_checks_off() -> Iterator[None]:
    """transformers' own switch for its value checks (``TRANSFORMERS_DISABLE_TORCH_CHECK``),
    set while a traced forward runs; the checks allocate nothing."""
    key = "TRANSFORMERS_DISABLE_TORCH_CHECK"
    before = os.environ.get(key)
    os.environ[key] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[key]
        else:
            os.environ[key] = before


def one_sequence_per_row() -> contextlib.AbstractContextManager:
    """transformers 5's causal mask looks for packed sequences in the position ids
    (``masking_utils.find_packed_sequence_indices``, reached when there is no cache, as
    under gradient checkpointing) and, where it cannot read their values (fake tensors:
    ``is_tracing``), keeps the packed-sequence mask: a ``[batch, 1, seq, seq]`` mask is
    built and SDPA loses ``is_causal`` (and grouped-query attention its ``enable_gqa``).
    The example batches hold one sequence per row (positions 0..seq-1), for which a real
    run's answer is None; the function still runs, for its temporaries."""
    import sys

    masking = sys.modules.get("transformers.masking_utils")
    find = getattr(masking, "find_packed_sequence_indices", None)
    if find is None:
        return contextlib.nullcontext()

    def unpacked(position_ids: torch.Tensor) -> None:
        find(position_ids)

    return patched([(masking, "find_packed_sequence_indices", unpacked)])


def model_kind(model: nn.Module) -> str:
    """What the model takes and returns, from its class and config."""
    arch = type(model).__name__
    config = model.config
    if arch.endswith("ForCausalLM") or arch.endswith("LMHeadModel"):
        return "causal-lm"
    if arch.endswith("ForConditionalGeneration"):
        if hasattr(config, "num_mel_bins"):
            return "speech-seq2seq"
        if getattr(config, "is_encoder_decoder", False):
            return "seq2seq"
        vision = getattr(config, "vision_config", None)
        if vision is not None and hasattr(config, "image_token_id"):
            if not hasattr(vision, "image_size"):  # Qwen2-VL: images at their own resolution
                raise UserError(
                    f"{arch}: images of variable resolution (a grid of patches per image) "
                    "are not built yet; LLaVA-style models with a fixed image_size are"
                )
            return "vision-language"
    if arch.endswith("ForMaskedLM"):
        return "masked-lm"
    if arch.endswith("ForImageClassification"):
        return "image-classification"
    if arch.endswith("ForSequenceClassification"):
        return "sequence-classification"
    if hasattr(model, "get_text_features") and hasattr(model, "get_image_features"):
        return "contrastive"
    if arch.endswith("Model") and not getattr(config, "is_encoder_decoder", False):
        return "embedding"
    raise UserError(f"hf model architecture {arch} is not supported yet")


def _max_positions(config) -> int | None:
    for key in _POSITION_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value - (2 if config.model_type == "roberta" else 0)
    return None


def learned_positions(config) -> int | None:
    """The position table of a model with learned positions (None for rotary ones)."""
    return _max_positions(config) if config.model_type in _ABSOLUTE_POSITIONS else None


def text_length(config, recipe: Recipe, label: str, learned: bool = False) -> int:
    """Tokens per sample: --seq-len (or a 1-d --input-shape), else 512 or the model's
    limit; refused past a table of learned positions."""
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
    learned = learned or config.model_type in _ABSOLUTE_POSITIONS
    if limit is not None and learned and seq_len > limit:
        raise UserError(f"{label} has {limit} learned positions; --seq-len {seq_len} is longer")
    return seq_len


def image_shape(config, recipe: Recipe) -> tuple[int, ...]:
    """(channels, size, size) from the (vision) config, unless --input-shape gives one."""
    if recipe.input_shape is not None:
        if len(recipe.input_shape) != 3:
            raise UserError(f"image models take --input-shape CxHxW, got {recipe.input_shape}")
        return recipe.input_shape
    size = getattr(config, "image_size", DEFAULT_IMAGE_SIZE)
    size = size[0] if isinstance(size, (list, tuple)) else size
    return (getattr(config, "num_channels", 3), size, size)


def speech_features(config) -> tuple[int, int]:
    """Whisper's encoder input: (mel bins, frames); the encoder's two convolutions halve
    the frames to its ``max_source_positions``."""
    return config.num_mel_bins, 2 * config.max_source_positions


def _decoder_length(recipe: Recipe, default: int, limit: int | None, label: str) -> int:
    length = recipe.target_len or default
    if limit is not None and length > limit:
        raise UserError(f"{label}'s decoder has {limit} learned positions; --target-len {length}")
    return length


def example_inputs(model: nn.Module, kind: str, recipe: Recipe, label: str) -> ExampleInputs:
    """The batch ``kind`` takes, sized from the model's config and the recipe."""
    config = model.config
    if recipe.target_len is not None and kind not in ENCODER_DECODER:
        raise UserError(f"--target-len: {label} has no decoder of its own (not encoder-decoder)")
    if kind == "image-classification":
        return _image_classification(config, recipe)
    if kind == "speech-seq2seq":
        return _speech(config, recipe, label)
    if kind == "contrastive":
        return _contrastive(config, recipe, label)
    if kind == "vision-language":
        typed = "token_type_ids" in inspect.signature(model.forward).parameters
        return _vision_language(config, recipe, label, typed)
    if kind == "embedding":
        return _embedding(config, recipe, label)
    return _text(config, kind, recipe, label)


EMBEDDING_NOTE = (
    "a bare encoder ({arch}): trained on its pooled embeddings with an in-batch contrastive "
    "loss, as sentence-transformers' MultipleNegativesRankingLoss (one pass per step; a "
    "batch of pairs runs the encoder on each side)"
)


def _embedding(config, recipe: Recipe, label: str) -> ExampleInputs:
    """A bare encoder (``BertModel``, ``Dinov2Model``): images where the config has an
    image size, else tokens; no labels (the loss pairs each sample with itself)."""
    if hasattr(config, "image_size") and hasattr(config, "num_channels"):
        shape = image_shape(config, recipe)

        def make_images(batch_size: int, dtype: torch.dtype) -> Batch:
            return {"pixel_values": torch.randn(batch_size, *shape, dtype=dtype)}

        notes = [] if recipe.input_shape else [f"{_image_note(shape)} (--input-shape)"]
        return ExampleInputs(shape, make_images, sequence=False, notes=notes)
    seq_len = text_length(config, recipe, label)
    vocab = config.vocab_size

    def make_tokens(batch_size: int, dtype: torch.dtype) -> Batch:
        return {"input_ids": torch.randint(0, vocab, (batch_size, seq_len))}

    return ExampleInputs((seq_len,), make_tokens, sequence=True)


def _image_classification(config, recipe: Recipe) -> ExampleInputs:
    shape = image_shape(config, recipe)
    classes = config.num_labels

    def make_batch(batch_size: int, dtype: torch.dtype) -> Batch:
        return {
            "pixel_values": torch.randn(batch_size, *shape, dtype=dtype),
            "labels": torch.randint(0, classes, (batch_size,)),
        }

    notes = [] if recipe.input_shape else [f"{_image_note(shape)} (--input-shape)"]
    return ExampleInputs(shape, make_batch, sequence=False, notes=notes)


def _image_note(shape: tuple[int, ...]) -> str:
    return f"images {'x'.join(map(str, shape))}: the config's image_size"


def _fixed_image(recipe: Recipe, label: str) -> None:
    if recipe.input_shape is not None:
        raise UserError(
            f"{label}: the image size is the vision config's (its positions are learned); "
            "--input-shape cannot change it"
        )


ENCODER_KINDS = ("masked-lm", "sequence-classification")


def extended_mask(batch_size: int, seq_len: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive attention mask transformers 4.x's encoders built when the batch had
    none: ``BertModel.forward`` made ``attention_mask = torch.ones(batch, seq)`` and
    ``get_extended_attention_mask`` turned it into ``(1 - mask[:, None, None, :]) *
    -10000`` cast to the parameters' dtype, which every layer adds to its scores
    (4.15.0's ``modeling_bert.py`` and ``modeling_utils.py``, read from its wheel:
    benchmarks/results/2026-11-23-device-rows.md). transformers 5.23 skips a missing or
    all-ones mask, so the scores keep the matmul's dtype; a 4D float mask it adds as
    given, which this is.

    >>> extended_mask(2, 8, torch.float32).shape
    torch.Size([2, 1, 1, 8])
    """
    return torch.zeros(batch_size, 1, 1, seq_len, dtype=dtype)


def _text(config, kind: str, recipe: Recipe, label: str) -> ExampleInputs:
    seq_len = text_length(config, recipe, label)
    target = seq_len
    notes = []
    if recipe.additive_mask:
        if kind not in ENCODER_KINDS:
            raise UserError(
                f"--additive-mask: {label} is a {kind} model; the mask is the encoders' "
                f"({', '.join(ENCODER_KINDS)})"
            )
        notes.append(
            "attention mask as transformers 4.x built it: always added to the scores, in "
            "the weights' dtype (--additive-mask)"
        )
    if kind == "seq2seq":
        target = _decoder_length(recipe, seq_len, None, label)
        if recipe.target_len is None:
            notes.append(f"decoder length {target}: the encoder's (--target-len to change it)")
    vocab = config.vocab_size

    def make_batch(batch_size: int, dtype: torch.dtype) -> Batch:
        ids = torch.randint(0, vocab, (batch_size, seq_len))
        if kind == "sequence-classification":
            labels = torch.randint(0, config.num_labels, (batch_size,))
        elif kind == "seq2seq" and target != seq_len:
            labels = torch.randint(0, vocab, (batch_size, target))
        else:
            labels = ids
        batch = {"input_ids": ids, "labels": labels}
        if recipe.additive_mask:
            batch["attention_mask"] = extended_mask(batch_size, seq_len, dtype)
        return batch

    return ExampleInputs((seq_len,), make_batch, sequence=True, notes=notes)


def _speech(config, recipe: Recipe, label: str) -> ExampleInputs:
    if recipe.seq_len is not None or recipe.input_shape is not None:
        bins, frames = speech_features(config)
        raise UserError(
            f"{label}'s encoder takes {bins} mel bins x {frames} frames (30 s); "
            "give the decoder's length with --target-len"
        )
    features = speech_features(config)
    limit = config.max_target_positions
    target = _decoder_length(recipe, limit, limit, label)
    vocab = config.vocab_size

    def make_batch(batch_size: int, dtype: torch.dtype) -> Batch:
        return {
            "input_features": torch.randn(batch_size, *features, dtype=dtype),
            "labels": torch.randint(0, vocab, (batch_size, target)),
        }

    notes = [
        f"speech input {features[0]} mel bins x {features[1]} frames from the config; "
        f"decoder length {target}"
        + ("" if recipe.target_len else " (max_target_positions; --target-len to change it)")
    ]
    return ExampleInputs(features, make_batch, sequence=False, notes=notes)


def _contrastive(config, recipe: Recipe, label: str) -> ExampleInputs:
    text, vision = config.text_config, config.vision_config
    seq_len = recipe.seq_len or _max_positions(text) or DEFAULT_SEQ_LEN
    limit = _max_positions(text)
    if limit is not None and seq_len > limit:
        raise UserError(f"{label}'s text tower has {limit} positions; --seq-len {seq_len}")
    _fixed_image(recipe, label)
    shape = image_shape(vision, recipe)
    vocab = text.vocab_size

    def make_batch(batch_size: int, dtype: torch.dtype) -> Batch:
        return {
            "input_ids": torch.randint(0, vocab, (batch_size, seq_len)),
            "pixel_values": torch.randn(batch_size, *shape, dtype=dtype),
        }

    notes = [f"{_image_note(shape)}; text {seq_len} tokens (--seq-len)"]
    return ExampleInputs(
        (seq_len,), make_batch, sequence=True, notes=notes, loss_kwargs={"return_loss": True}
    )


def image_tokens(config) -> int:
    """Image tokens a vision-language model puts in the text for one image: Gemma 3's
    projector pools the vision patches to ``mm_tokens_per_image`` (256 for 4096 patches);
    a LLaVA-style model keeps one per patch (the CLS token dropped by the ``default``
    feature strategy)."""
    pooled = getattr(config, "mm_tokens_per_image", None)
    if pooled:
        return int(pooled)
    vision = config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    strategy = getattr(config, "vision_feature_select_strategy", "default")
    return patches + (1 if strategy == "full" else 0)


def _vision_language(config, recipe: Recipe, label: str, typed: bool) -> ExampleInputs:
    """One image's tokens before the text; with ``typed`` (Gemma 3, PaliGemma) the
    ``token_type_ids`` their processors return (1 on image tokens), from which the model
    builds its attention mask, bidirectional within an image."""
    text = text_length(config.text_config, recipe, label)
    _fixed_image(recipe, label)
    shape = image_shape(config.vision_config, recipe)
    images = image_tokens(config)
    seq_len = images + text
    vocab, image_id = config.text_config.vocab_size, config.image_token_id

    def make_batch(batch_size: int, dtype: torch.dtype) -> Batch:
        ids = torch.cat(
            [
                torch.full((batch_size, images), image_id),
                torch.randint(0, min(vocab, image_id), (batch_size, text)),
            ],
            dim=1,
        )
        batch = {
            "input_ids": ids,
            "pixel_values": torch.randn(batch_size, *shape, dtype=dtype),
            "labels": ids,
        }
        if typed:
            batch["token_type_ids"] = (ids == image_id).long()
        return batch

    notes = [  # generate states its own prompt (image tokens + --prompt-len)
        f"one image per sample ({_image_note(shape)}) as {images} image tokens before "
        f"{text} text tokens (--seq-len): {seq_len} tokens"
    ]
    if recipe.mode == "generate":
        notes = []
    return ExampleInputs((seq_len,), make_batch, sequence=True, notes=notes, value_checks=False)
