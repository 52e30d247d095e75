"""Generation traced as transformers' ``generate`` runs it: the prefill, the cache's
growth, and the last decode step.

The prefill runs the prompt once with the cache generate builds and (where the model
takes ``logits_to_keep``) logits for the last position only; the next-token logits are
copied to fp32 as ``generate`` does. A ``DynamicCache`` then grows by ``torch.cat`` at
every decode step: each layer's keys and values get a new block one token longer and
the old one is freed. That growth is recorded storage by storage without running the
steps (at most ``GROWTH_STEPS`` of them, in equal strides beyond), so the allocator
replay sees the freed blocks it leaves behind; the last decode step is traced for real
with the cache at ``prompt + new_tokens - 2`` tokens, and grows it to
``prompt + new_tokens - 1``. A ``StaticCache`` is allocated at the prefill's first
update with ``prompt + new_tokens - 1`` positions and written in place. The prefill is
iteration 1 of the forward phase, the decode step iteration 2::

    trace = trace_generation(built, Recipe(mode="generate", prompt_len=512,
                                           new_tokens=128), CudaPolicy())
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from vramplan.errors import UserError
from vramplan.limits import time_limit
from vramplan.recipe import DEFAULT_NEW_TOKENS, Recipe
from vramplan.result import Component, Phase
from vramplan.sources.base import BuiltModel
from vramplan.sources.generation import cache_layers
from vramplan.sources.hf_inputs import speech_features
from vramplan.sources.kv_quant import (
    DEFAULTS as KV_DEFAULTS,
)
from vramplan.sources.kv_quant import (
    KvQuantization,
    quantized,
    quantized_storages,
)
from vramplan.trace.events import Trace
from vramplan.trace.policy import DevicePolicy
from vramplan.trace.recorder import AllocationRecorder, StorageRecord
from vramplan.trace.step import prepare_model_for, tracing

GROWTH_STEPS = 256
"""Decode steps whose cache growth is recorded one by one; more grow in equal strides."""
DEFAULT_PROMPT = 512
PREFILL, DECODE = 1, 2
"""The forward iterations of the prefill and of the last decode step."""


@dataclass(frozen=True)
class GenerationShape:
    """What one ``generate`` call runs: ``sequences`` (batch × beams) prompts of
    ``prompt`` tokens, ``new_tokens`` generated, with a ``cache`` (dynamic or static).

    >>> shape = GenerationShape(sequences=2, prompt=100, new_tokens=20, cache="dynamic")
    >>> shape.final_cache_len, shape.decode_steps
    (119, 19)
    """

    sequences: int
    prompt: int
    new_tokens: int
    cache: str
    kv: KvQuantization | None = None
    """The quantized cache's backend and settings (None: a dynamic or static cache)."""

    @property
    def final_cache_len(self) -> int:
        """Tokens in the cache after the last decode step (the last token is not fed)."""
        return self.prompt + self.new_tokens - 1

    @property
    def decode_steps(self) -> int:
        """Forward passes after the prefill."""
        return self.new_tokens - 1


def generation_shape(recipe: Recipe, image_tokens: int = 0) -> GenerationShape:
    """The shape of the generate call a ``--mode generate`` recipe describes (a prompt of
    ``image_tokens`` before its text tokens)."""
    prompt = (recipe.prompt_len or recipe.seq_len or DEFAULT_PROMPT) + image_tokens
    kv = None
    if recipe.cache not in ("dynamic", "static"):
        kv = KvQuantization(
            recipe.cache,
            nbits=recipe.kv_bits or KV_DEFAULTS["nbits"],
            q_group_size=recipe.kv_group_size or KV_DEFAULTS["q_group_size"],
            residual_length=recipe.kv_residual_length or KV_DEFAULTS["residual_length"],
        )
    return GenerationShape(
        sequences=recipe.batch_size * recipe.num_beams,
        prompt=prompt,
        new_tokens=recipe.new_tokens or DEFAULT_NEW_TOKENS,
        cache=recipe.cache,
        kv=kv,
    )


def growth_lengths(start: int, end: int, limit: int = GROWTH_STEPS) -> list[int]:
    """The cache lengths after each recorded growth step from ``start`` to ``end`` tokens:
    one token a step, or at most ``limit`` equal strides.

    >>> growth_lengths(10, 14)
    [11, 12, 13, 14]
    >>> growth_lengths(0, 1000, limit=4)
    [250, 500, 750, 1000]
    """
    steps = end - start
    count = min(steps, limit)
    return [start + (i * steps) // count for i in range(1, count + 1)] if count > 0 else []


def _window(layer: Any) -> int | None:
    """The window of a sliding-window cache layer (None for a full one)."""
    return getattr(layer, "sliding_window", None) if getattr(layer, "is_sliding", False) else None


def _stored(window: int | None, seen: int) -> int:
    """Tokens the storage of a dynamic layer holds after the decode update that brought it
    to ``seen`` tokens: all of them, or for a sliding layer the ``torch.cat`` of its last
    ``window - 1`` tokens and the new one.

    >>> _stored(None, 100), _stored(16, 100), _stored(16, 10)
    (100, 16, 10)
    """
    return seen if window is None else min(seen - 1, window - 1) + 1


def _tag_cache(recorder: AllocationRecorder, cache: Any) -> None:
    for layer in cache_layers(cache):
        held = (getattr(layer, "keys", None), getattr(layer, "values", None))
        for tensor in (*held, *quantized_storages(layer)):
            if isinstance(tensor, torch.Tensor):
                record = recorder.record_for(tensor)
                if record is not None:
                    record.tags.add(Component.KV_CACHE)


@dataclass(frozen=True)
class _Slot:
    """One cached tensor of one layer: where it lives and its shape but the length."""

    layer: Any
    name: str
    batch: int
    heads: int
    dim: int
    dtype: torch.dtype

    @property
    def per_token(self) -> int:
        return self.batch * self.heads * self.dim * self.dtype.itemsize


def _slots(cache: Any) -> list[_Slot]:
    slots = []
    for layer in cache_layers(cache):
        keys = getattr(layer, "keys", None)
        if not isinstance(keys, torch.Tensor) or not keys.numel():
            continue
        if type(layer).__name__ not in ("DynamicLayer", "DynamicSlidingWindowLayer"):
            raise UserError(
                "--mode generate models DynamicCache layers (full and sliding-window); "
                f"this model's cache has a {type(layer).__name__}"
            )
        for name in ("keys", "values"):
            batch, heads, _, dim = getattr(layer, name).shape
            slots.append(_Slot(layer, name, batch, heads, dim, keys.dtype))
    return slots


def grow_cache(
    recorder: AllocationRecorder, cache: Any, lengths: list[int], reorder: bool = False
) -> list[str]:
    """Record a dynamic cache growing through ``lengths`` (tokens seen after each step):
    per step and layer, the keys' new block then the old one freed, then the values'.
    With ``reorder`` (beam search), every step ends with generate's ``reorder_cache``:
    each layer's keys and values ``index_select``-ed into a new block of the same size,
    the old one freed (``DynamicLayer.reorder_cache``). The last step leaves real (fake)
    tensors in the cache; returns notes."""
    slots = _slots(cache)
    if not lengths or not slots:
        return []
    held: dict[int, StorageRecord] = {}
    for step, seen in enumerate(lengths, start=1):
        for index, slot in enumerate(slots):
            window = _window(slot.layer)
            stored = _stored(window, seen)
            if step < len(lengths):
                record = recorder.note_alloc(stored * slot.per_token, "cat")
                record.tags.add(Component.KV_CACHE)
                if index in held:
                    recorder.note_free(held[index])
                else:  # the prefill's tensor, freed as the cache lets go of it
                    setattr(slot.layer, slot.name, None)
                held[index] = record
                continue
            full = torch.empty(slot.batch, slot.heads, stored, slot.dim, dtype=slot.dtype)
            recorder.record_for(full).tags.add(Component.KV_CACHE)
            if index in held:
                recorder.note_free(held[index])
            visible = stored if window is None else min(stored, window - 1)
            setattr(slot.layer, slot.name, full[:, :, stored - visible :, :])
            del full
        if reorder:
            _reorder(recorder, slots, held, last=step == len(lengths))
        for layer in {id(s.layer): s.layer for s in slots}.values():
            if _window(layer) is not None:
                layer.cumulative_length = seen
    if lengths[-1] - lengths[0] + 1 > len(lengths):
        stride = (lengths[-1] - lengths[0]) // max(len(lengths) - 1, 1)
        return [
            f"cache growth replayed in {len(lengths)} equal strides of about {stride} tokens "
            "(not one token at a time)"
        ]
    return []


def _reorder(
    recorder: AllocationRecorder, slots: list[_Slot], held: dict[int, StorageRecord], last: bool
) -> None:
    """One ``reorder_cache``: per layer, the keys then the values copied by
    ``index_select`` and the old block freed (real tensors at the ``last`` step)."""
    for index, slot in enumerate(slots):
        if last:
            old = getattr(slot.layer, slot.name)
            copy = torch.empty_like(old, memory_format=torch.contiguous_format)
            recorder.record_for(copy).tags.add(Component.KV_CACHE)
            setattr(slot.layer, slot.name, copy)
            del old, copy
            continue
        record = recorder.note_alloc(held[index].nbytes, "index_select")
        record.tags.add(Component.KV_CACHE)
        recorder.note_free(held[index])
        held[index] = record


def quantized_split(kv: KvQuantization, prompt: int, seen: int) -> tuple[int, int]:
    """(quantized, full-precision) tokens a quantized layer holds once it has seen
    ``seen`` tokens: the prefill quantizes the prompt; each decode step adds one token to
    the residual, and the step that fills it to ``residual_length`` quantizes everything.

    >>> quantized_split(KvQuantization("quanto", residual_length=128), 100, 400)
    (356, 44)
    >>> quantized_split(KvQuantization("fp8"), 100, 400)
    (400, 0)
    """
    if kv.backend == "fp8":
        return seen, 0
    residual = (seen - prompt) % kv.residual_length
    return seen - residual, residual


def set_quantized_cache(cache: Any, kv: KvQuantization, prompt: int, seen: int) -> list[str]:
    """Put every quantized layer in the state it has after ``seen`` tokens (the decode
    steps before the last are not replayed one by one); returns notes."""
    packed, residual = quantized_split(kv, prompt, seen)
    for layer in cache_layers(cache):
        batch, heads, _, dim = (
            layer._quantized_keys.shape if kv.backend != "fp8" else layer._quantized_keys[0].shape
        )
        dtype = layer.keys.dtype  # lazy_initialization made keys in the states' dtype
        shape = (batch, heads, packed, dim)
        if kv.backend == "fp8":
            for name in ("_quantized_keys", "_quantized_values"):
                values, scale = getattr(layer, name)
                setattr(layer, name, (torch.empty(shape, dtype=values.dtype), scale))
        else:
            layer._quantized_keys = quantized(kv, shape, dtype)
            layer._quantized_values = quantized(kv, shape, dtype)
            layer.keys = torch.empty(batch, heads, residual, dim, dtype=dtype)
            layer.values = torch.empty(batch, heads, residual, dim, dtype=dtype)
        layer.cumulative_length = seen
    window = "" if kv.backend == "fp8" else f", {residual} in full precision"
    return [
        f"{kv.backend} KV cache: {packed} tokens quantized{window} before the last decode "
        "step (set at once; the re-quantizations before it are not replayed; the "
        "backend's own temporaries while quantizing are not modelled)"
    ]


def _dtype(model: Any) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (fp32 if none)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _next_token(output: Any) -> torch.Tensor:
    """What generate keeps of an output: the last position's logits copied to fp32."""
    logits = output.logits if hasattr(output, "logits") else output[0]
    return logits[:, -1].to(copy=True, dtype=torch.float32)


def trace_generation(built: BuiltModel, recipe: Recipe, policy: DevicePolicy) -> Trace:
    """Trace ``generate`` of ``built`` as ``recipe`` (``mode="generate"``) describes it."""
    generator = built.generator
    if generator is None:
        raise UserError(
            f"--mode generate: {built.name} is not a causal language model that "
            "transformers' generate runs (hf: ...ForCausalLM configs are, and the "
            "encoder-decoder T5 and Whisper)"
        )
    if generator.encoder_decoder:
        return trace_encoder_decoder(built, recipe, policy)
    images = generator.image.tokens if generator.image else 0
    shape = generation_shape(recipe, images)
    generator.check_length(built.name, shape.final_cache_len + 1)
    with _generation_session(built, recipe, policy) as session:
        model = built.model
        recorder = session.recorder

        def phase(iteration: int) -> None:
            recorder.set_phase(Phase.FORWARD, iteration)
            session.modules.reset()

        phase(PREFILL)
        ids = generator.prompt_ids(shape.sequences, shape.prompt - images)
        extras = generator.prefill_extras(shape.sequences, _dtype(model))
        session.tag_inputs((ids, *extras.values()))
        cache = generator.new_cache(shape.cache, shape.final_cache_len, shape.kv)
        with torch.no_grad(), policy.autocast(recipe):
            output = generator.forward(model, ids, cache, 0, **extras)  # extras kept, as
            # generate keeps pixel_values in its model_kwargs to the end
            logits = _next_token(output)
            del output
        _tag_cache(recorder, cache)
        if shape.decode_steps:
            phase(DECODE)
            before = shape.final_cache_len - 1
            if shape.cache == "dynamic":
                lengths = growth_lengths(shape.prompt, before)
                beams = recipe.num_beams > 1
                session.notes.extend(grow_cache(recorder, cache, lengths, reorder=beams))
            elif shape.kv is not None:
                session.notes.extend(set_quantized_cache(cache, shape.kv, shape.prompt, before))
            token = torch.randint(0, generator.vocab_size, (shape.sequences, 1))
            with torch.no_grad(), policy.autocast(recipe):
                output = generator.forward(model, token, cache, before)
                del logits
                logits = _next_token(output)
                del output
            _tag_cache(recorder, cache)
        session.notes.extend(generation_notes(recipe, shape, generator.keeps_last_logits))
        if images:
            session.notes.append(
                f"one image per prompt: {images} image tokens before the "
                f"{shape.prompt - images} text tokens, the vision tower run in the prefill"
            )
    return session.finish()


@contextlib.contextmanager
def _generation_session(built: BuiltModel, recipe: Recipe, policy: DevicePolicy):
    """The tracing session of one traced ``generate``, under the time limit, with the
    model prepared as the recipe stores it and the preparation's and model's notes."""
    notes = prepare_model_for(built, recipe)
    with (
        time_limit(f"the traced generation of {built.name}"),
        tracing(
            built.model, policy, recipe, built.name, "check --prompt-len / --new-tokens"
        ) as session,
        built.step_context(),
    ):
        session.notes.extend(notes + built.notes)
        session.prepare_model(built.model)
        yield session


def _check_encoder_decoder(built: BuiltModel, recipe: Recipe) -> None:
    """Refuse what the encoder-decoder trace does not model."""
    what = f"--mode generate of the encoder-decoder {built.name}"
    if recipe.cache != "dynamic" or recipe.num_beams > 1:
        raise UserError(f"{what} models greedy decoding with the dynamic cache only")
    if (recipe.new_tokens or DEFAULT_NEW_TOKENS) < 2:
        raise UserError(f"{what} needs --new-tokens 2 or more")
    if built.kind == "speech-seq2seq" and (recipe.prompt_len or recipe.seq_len):
        raise UserError(
            f"{built.name}'s encoder reads 30 s of mel features whatever the audio; "
            "leave out --prompt-len"
        )


def _encoder_inputs(built: BuiltModel, recipe: Recipe, sequences: int) -> torch.Tensor:
    """What generate hands the encoder: token ids, or Whisper's 30 s of mel features."""
    config = built.generator.config
    if built.kind == "speech-seq2seq":
        bins, frames = speech_features(config)
        return torch.randn(sequences, bins, frames, dtype=built.model.dtype)
    prompt = recipe.prompt_len or recipe.seq_len or DEFAULT_PROMPT
    return torch.randint(0, built.generator.vocab_size, (sequences, prompt))


def trace_encoder_decoder(built: BuiltModel, recipe: Recipe, policy: DevicePolicy) -> Trace:
    """``generate`` of an encoder-decoder model (T5, Whisper) as transformers runs it: the
    encoder once over the prompt (kept to the end), then the decoder from
    ``decoder_start_token_id`` one token a step against an ``EncoderDecoderCache`` whose
    cross-attention half is filled at the first step (encoder length) and whose
    self-attention half grows a token a step. Iteration 1 is the encoder and the first
    decoder step, iteration 2 the last decode step."""
    _check_encoder_decoder(built, recipe)
    generator = built.generator
    new_tokens = recipe.new_tokens or DEFAULT_NEW_TOKENS
    generator.check_length(built.name, new_tokens + 1)
    sequences = recipe.batch_size
    with _generation_session(built, recipe, policy) as session:
        model = built.model
        recorder = session.recorder
        recorder.set_phase(Phase.FORWARD, PREFILL)
        session.modules.reset()
        inputs = _encoder_inputs(built, recipe, sequences)
        session.tag_inputs(inputs)
        mask = None if inputs.is_floating_point() else torch.ones_like(inputs)
        cache = generator.new_encoder_decoder_cache()
        start = torch.full((sequences, 1), generator.decoder_start)
        with torch.no_grad(), policy.autocast(recipe):
            encoded = generator.encode(model, inputs)
            output = generator.decode(model, encoded, mask, start, cache)
            logits = _next_token(output)
            del output
        _tag_cache(recorder, cache.self_attention_cache)
        _tag_cache(recorder, cache.cross_attention_cache)
        recorder.set_phase(Phase.FORWARD, DECODE)
        session.modules.reset()
        lengths = growth_lengths(1, new_tokens - 1)
        session.notes.extend(grow_cache(recorder, cache.self_attention_cache, lengths))
        token = torch.randint(0, generator.vocab_size, (sequences, 1))
        with torch.no_grad(), policy.autocast(recipe):
            output = generator.decode(model, encoded, mask, token, cache)
            del logits
            logits = _next_token(output)
            del output
        _tag_cache(recorder, cache.self_attention_cache)
        del logits, encoded  # generate's next-token logits and encoder output, held to here
        session.notes.append(
            f"generate (encoder-decoder): the encoder once over {inputs.shape[-1]} "
            f"{'mel frames' if mask is None else 'prompt tokens'} (its output kept), then "
            f"{new_tokens} decoder steps from decoder_start_token_id {generator.decoder_start}"
            f"; the cross-attention cache is filled at the first, the self-attention cache "
            f"reaches {new_tokens} tokens; the last step is traced"
            + ("; Whisper's forced language/task tokens are not modelled" if mask is None else "")
        )
    return session.finish()


def encoder_decoder_details(trace: Trace, recipe: Recipe) -> dict[str, int]:
    """The figures of a traced encoder-decoder generation: the cross-attention cache (the
    cache tensors the first step wrote that are still held: the self-attention ones it
    wrote were replaced as the cache grew) and the self-attention cache at the end."""
    live = [
        a for a in trace.allocations if a.category == Component.KV_CACHE and a.free_index is None
    ]
    cross = sum(a.nbytes for a in live if a.iteration == PREFILL)
    total = sum(a.nbytes for a in live)
    return {
        "cross_cache_bytes": cross,
        "self_cache_bytes": total - cross,
        "self_cache_tokens": recipe.new_tokens or DEFAULT_NEW_TOKENS,
    }


def generation_notes(recipe: Recipe, shape: GenerationShape, keeps_last: bool) -> list[str]:
    """What the traced generate call was, and what it leaves out."""
    logits = (
        "logits of the last position only, logits_to_keep=1"
        if keeps_last
        else "all logits: the model takes no logits_to_keep"
    )
    notes = [
        f"generate: prefill of {shape.prompt} tokens ({logits})"
        + f", then {shape.decode_steps} decode steps to a {shape.cache} cache of "
        f"{shape.final_cache_len} tokens; the last decode step is traced"
    ]
    if recipe.num_beams > 1:
        notes.append(
            f"beam search: {recipe.num_beams} beams per prompt run as {shape.sequences} "
            "sequences; the cache's per-step reorder (an index_select of each layer) "
            "replayed with its growth"
            + ("" if recipe.cache == "dynamic" else " (dynamic cache only)")
            + "; the beam scorer's own tensors are not modelled"
        )
    return notes


def generation_details(
    trace: Trace, recipe: Recipe, encoder_decoder: bool = False, image_tokens: int = 0
) -> dict[str, int]:
    """The figures of a traced generation (tensor bytes, before the allocator's rounding):
    the peaks of the prefill and of the last decode step, the cache at the end, and the
    cache per token of one sequence (read from the cache the prefill wrote, whose every
    layer holds each prompt token — a static cache each of its positions — before any
    sliding window drops one)."""
    shape = generation_shape(recipe, image_tokens)
    peaks = {PREFILL: 0, DECODE: 0}
    live = 0
    for event in trace.events():
        live += event.delta
        iteration = trace.phase_at(event.index).iteration
        if iteration in peaks:
            peaks[iteration] = max(peaks[iteration], live)
    cache = sum(
        a.nbytes
        for a in trace.allocations
        if a.category == Component.KV_CACHE and a.free_index is None
    )
    if encoder_decoder:
        return {
            "new_tokens": recipe.new_tokens or DEFAULT_NEW_TOKENS,
            "sequences": recipe.batch_size,
            "prefill_peak_bytes": peaks[PREFILL],
            "decode_peak_bytes": peaks[DECODE],
            "kv_cache_bytes": cache,
            **encoder_decoder_details(trace, recipe),
        }
    tokens = (
        shape.final_cache_len if shape.decode_steps or shape.cache == "static" else shape.prompt
    )
    prefilled = sum(
        a.nbytes
        for a in trace.allocations
        if a.category == Component.KV_CACHE and a.iteration == PREFILL
    )
    written = shape.final_cache_len if shape.cache == "static" else shape.prompt
    return {
        "prompt_tokens": shape.prompt,
        "new_tokens": shape.new_tokens,
        "sequences": shape.sequences,
        "cache": shape.cache,
        "prefill_peak_bytes": peaks[PREFILL],
        "decode_peak_bytes": peaks[DECODE],
        "kv_cache_bytes": cache,
        "kv_cache_tokens": tokens,
        "kv_bytes_per_token": prefilled // (shape.sequences * written),
    }
