"""How transformers' ``generate`` calls a causal language model: the cache it builds and
the forward calls of the prefill and of a decode step (``trace/generate.py`` traces them).

``generate`` (transformers 4.45+, ``GenerationMixin``) passes ``logits_to_keep=1`` to a
model whose ``forward`` accepts it, so the prefill computes logits for the last position
only; older models without the argument compute all of them. The default cache is a
``DynamicCache`` (grown by ``torch.cat`` at every step); ``cache_implementation="static"``
builds a ``StaticCache`` of ``max_length - 1`` positions, allocated at the first update::

    >>> from vramplan.recipe import Recipe
    >>> from vramplan.sources.hf import build_hf
    >>> generator = build_hf("gpt2", Recipe(mode="generate")).generator
    >>> generator.keeps_last_logits, generator.vocab_size
    (True, 50257)
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vramplan.errors import UserError
from vramplan.sources.hf_inputs import value_checks_off
from vramplan.sources.kv_quant import KvQuantization, quantized_cache


@dataclass(frozen=True)
class ImagePrompt:
    """A LLaVA-style model's image in the prompt: ``tokens`` image tokens (id
    ``token_id``) before the text, and the ``pixels`` (channels, height, width) the
    prefill's vision tower reads."""

    tokens: int
    token_id: int
    pixels: tuple[int, ...]


@dataclass(frozen=True)
class Generator:
    """The generate-time calls of one transformers causal LM (``config`` its config)."""

    config: Any
    vocab_size: int
    keeps_last_logits: bool
    """Whether ``forward`` takes ``logits_to_keep`` (so generate keeps one position)."""
    max_positions: int | None = None
    """Learned positions: prompt plus new tokens must fit them (None: no such limit)."""
    decoder_start: int | None = None
    """An encoder-decoder model's ``decoder_start_token_id`` (None: a causal LM)."""
    image: ImagePrompt | None = None
    """A vision-language model's image, counted into the prompt (None: text only)."""

    def prompt_ids(self, sequences: int, text: int) -> torch.Tensor:
        """The prefill's token ids: the image tokens (if any), then ``text`` tokens."""
        ids = torch.randint(0, self.vocab_size, (sequences, text))
        if self.image is None:
            return ids
        ids = ids.clamp(max=self.image.token_id - 1) if self.image.token_id else ids
        images = torch.full((sequences, self.image.tokens), self.image.token_id)
        return torch.cat([images, ids], dim=1)

    def prefill_extras(self, sequences: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """What only the prefill takes besides the ids: one image per sequence."""
        if self.image is None:
            return {}
        return {"pixel_values": torch.randn(sequences, *self.image.pixels, dtype=dtype)}

    @property
    def encoder_decoder(self) -> bool:
        """Whether generate runs an encoder once, then the decoder token by token."""
        return self.decoder_start is not None

    def check_length(self, name: str, total: int) -> None:
        """Refuse a generation longer than the model's learned position table."""
        if self.max_positions is not None and total > self.max_positions:
            raise UserError(
                f"{name} has {self.max_positions} learned positions; a prompt plus new "
                f"tokens of {total} is longer"
            )

    def new_cache(self, kind: str, max_len: int, kv: KvQuantization | None = None) -> Any:
        """The cache generate builds: dynamic, static with ``max_len`` positions, or
        quantized (``kv``: ``cache_implementation="quantized"``)."""
        import transformers

        if kv is not None:
            return quantized_cache(self.config, kv)
        if kind == "static":
            return transformers.StaticCache(config=self.config, max_cache_len=max_len)
        return transformers.DynamicCache(config=self.config)

    def forward(
        self, model: nn.Module, ids: torch.Tensor, cache: Any, start: int, **extras: Any
    ) -> Any:
        """One forward as generate runs it: tokens ``ids`` at positions ``start...``,
        the cache, and only the last position's logits where the model allows."""
        batch, length = ids.shape
        positions = torch.arange(start, start + length).unsqueeze(0).expand(batch, length)
        kwargs = {"logits_to_keep": 1} if self.keeps_last_logits else {}
        checks = contextlib.nullcontext() if self.image is None else value_checks_off()
        with checks:  # LLaVA counts its image tokens by value: transformers' switch
            return model(
                input_ids=ids,
                position_ids=positions,
                **{cache_keyword(model): cache},
                use_cache=True,
                **kwargs,
                **extras,
            )

    def encode(self, model: nn.Module, inputs: torch.Tensor) -> Any:
        """The encoder run once over ``inputs`` (token ids, or Whisper's mel features), as
        ``_prepare_encoder_decoder_kwargs_for_generation`` runs it."""
        name = model.main_input_name
        mask = {} if name == "input_features" else {"attention_mask": torch.ones_like(inputs)}
        return model.get_encoder()(**{name: inputs}, **mask, return_dict=True)

    def new_encoder_decoder_cache(self) -> Any:
        """generate's default cache of an encoder-decoder model: an ``EncoderDecoderCache``
        of two ``DynamicCache``s (the decoder's self-attention, grown a token a step; the
        cross-attention, filled once from the encoder output)."""
        import transformers

        decoder = self.config.get_text_config(decoder=True)
        return transformers.EncoderDecoderCache(
            transformers.DynamicCache(config=decoder), transformers.DynamicCache(config=decoder)
        )

    def decode(
        self, model: nn.Module, encoded: Any, mask: torch.Tensor | None, ids: Any, cache: Any
    ) -> Any:
        """One decoder step as generate runs it: the encoder output, its mask, the new
        decoder tokens ``ids`` and the cache."""
        extra = {} if mask is None else {"attention_mask": mask}
        return model(
            encoder_outputs=encoded,
            decoder_input_ids=ids,
            **{cache_keyword(model): cache},
            use_cache=True,
            **extra,
        )


def cache_keyword(model: nn.Module) -> str:
    """The keyword a model's forward takes its cache by: ``cache`` from transformers 5.2x
    (``past_key_values`` is deprecated there and warns), ``past_key_values`` before."""
    return _cache_keyword(type(model))


@functools.cache
def _cache_keyword(model_class: type) -> str:
    takes = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in takes else "past_key_values"


def cache_layers(cache: Any) -> list[Any]:
    """The per-layer objects of a transformers cache (each holds ``keys`` and ``values``)."""
    return list(getattr(cache, "layers", []))


def generator_for(
    model: nn.Module, config: Any, max_positions: int | None, image: ImagePrompt | None = None
) -> Generator:
    """The ``Generator`` of a transformers causal LM (with ``image``: a LLaVA-style one)."""
    keeps = "logits_to_keep" in inspect.signature(model.forward).parameters
    start = getattr(config, "decoder_start_token_id", None)
    if getattr(config, "is_encoder_decoder", False) and start is None:
        start = config.pad_token_id  # T5 starts its decoder from the pad token
    decoder = start if getattr(config, "is_encoder_decoder", False) else None
    vocab = config.get_text_config(decoder=True).vocab_size
    return Generator(config, int(vocab), keeps, max_positions, decoder, image)
