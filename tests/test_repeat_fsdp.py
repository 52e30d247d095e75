"""Block repetition under FSDP2 on fake ranks: the rebuilt trace of one rank equals the
trace of every block, event for event, though FSDP2's buffers cross the blocks (a block's
all-gather output is freed in the next block's pre-forward, its reduce-scatter input in
the next block's post-backward, the first block in backward frees none and the last one
prefetches none)."""

from __future__ import annotations

import json

import pytest
from conftest import TINY_GPT2, assert_same_estimate, gqa_llama

from vramplan.device.options import device_options
from vramplan.distributed.fsdp import Fsdp2
from vramplan.pipeline import trace_and_estimate
from vramplan.recipe import Recipe
from vramplan.sources import resolve

WORLD = 8
CONFIGS = {
    "gpt2": {**TINY_GPT2, "n_embd": 64, "n_layer": 6},
    "llama": gqa_llama(6),
}


@pytest.fixture(autouse=True)
def _short_runs_repeat_too(monkeypatch):
    """The tiny models here have 6-10 blocks; repetition's thresholds are a speed policy."""
    monkeypatch.setattr("vramplan.trace.repeat.MIN_BLOCKS", 5)
    monkeypatch.setattr("vramplan.trace.repeat.SHORTER", 10.0)


def _both(tmp_path, config: dict, engine: Fsdp2, **knobs):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    recipe = Recipe(batch_size=2, seq_len=32, **knobs)
    device = device_options(gpu="a100-80gb", data_parallel=engine.world_size)
    results = []
    for repeat in (False, True):
        built = resolve(f"hf:{path}", recipe)
        built.repeat_blocks = repeat
        results.append(trace_and_estimate(built, recipe, "cuda", device, engine=engine))
    return results


def _assert_equal(full, repeated, note: str, blocks: int) -> None:
    assert_same_estimate(full, repeated, note)
    assert any(f"fully_shard on {blocks} blocks" in n for n in repeated[0].notes)


@pytest.mark.parametrize(
    ("kind", "knobs"),
    [
        ("gpt2", {}),
        ("gpt2", {"checkpointing": "full", "precision": "amp-bf16"}),
        ("gpt2", {"precision": "bf16", "optimizer": "sgd"}),
        ("llama", {}),
        ("llama", {"checkpointing": "full"}),
        ("llama", {"precision": "amp-bf16"}),
        ("llama", {"precision": "bf16", "checkpointing": "full"}),
        ("llama", {"optimizer": "sgd", "precision": "amp-bf16"}),
    ],
)
def test_fsdp_rank_repeats_its_blocks(tmp_path, kind, knobs):
    full, repeated = _both(tmp_path, CONFIGS[kind], Fsdp2(WORLD), **knobs)
    path = "transformer.h" if kind == "gpt2" else "model.layers"
    _assert_equal(full, repeated, f"repeated blocks: traced 2 and 3 of the 6 {path}", 6)


def test_kept_gathered_from_forward_to_backward(tmp_path):
    """``--shard grad-op``: no resharding after forward, each block's gathered parameters
    live from its forward to its backward."""
    engine = Fsdp2(WORLD, reshard_after_forward=False)
    full, repeated = _both(tmp_path, CONFIGS["llama"], engine, precision="amp-bf16")
    _assert_equal(full, repeated, "repeated blocks: traced 2 and 3 of the 6 model.layers", 6)


def test_checkpointed_in_part(tmp_path):
    """Five of ten blocks checkpointed: two stretches, each repeated with FSDP2's buffers
    crossing from one stretch into the other."""
    full, repeated = _both(tmp_path, gqa_llama(10), Fsdp2(WORLD), checkpointing="5")
    note = "repeated blocks: the 10 model.layers blocks are stretches of 5 blocks and 5 blocks"
    _assert_equal(full, repeated, note, 10)


@pytest.mark.parametrize(
    ("kind", "blocks", "knobs", "stretches"),
    [
        ("gpt2", 10, {"checkpointing": "every:2", "precision": "amp-bf16"}, "5 units of 2 blocks"),
        ("llama", 16, {"checkpointing": "every:3"}, "5 units of 3 blocks and 1 block"),
    ],
)
def test_every_nth_block_checkpointed(tmp_path, kind, blocks, knobs, stretches):
    """``--checkpointing every:N``: units of N blocks (the last one recomputes), and with
    a tail of plain blocks a second stretch; FSDP2's buffers cross the units as they
    cross the blocks. The device replay is the full trace's too: reserved to the byte."""
    config = {**CONFIGS["gpt2"], "n_layer": blocks} if kind == "gpt2" else gqa_llama(blocks)
    full, repeated = _both(tmp_path, config, Fsdp2(WORLD), **knobs)
    path = "transformer.h" if kind == "gpt2" else "model.layers"
    note = f"repeated blocks: the {blocks} {path} blocks are stretches of {stretches}"
    _assert_equal(full, repeated, note, blocks)
    assert repeated[0].peak == full[0].peak


def test_every_third_block_of_32_is_traced_whole(tmp_path, monkeypatch):
    """Llama-3-8B's 32 blocks with ``every:3``: 10 units of 3 and 2 plain blocks left over.
    The short traces (2, 3 and 4 units, each with the 2 left over: 8 + 11 + 14 blocks)
    would hold more blocks than the model, so one estimate traces every block, and says
    why, before tracing anything; ``every:2`` (4 + 6 + 8 of 32) is traced short."""
    from vramplan.trace.repeat import NotRepeatable, repeat_built

    monkeypatch.setattr("vramplan.trace.repeat.SHORTER", 0.6)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(gqa_llama(32)))
    traced = []

    def short_trace(built, recipe):
        traced.append(recipe.checkpointing)
        raise NotRepeatable("stopped here")

    def note_of(checkpointing: str) -> str:
        recipe = Recipe(batch_size=2, seq_len=32, checkpointing=checkpointing)
        built = resolve(f"hf:{path}", recipe)
        trace, note = repeat_built(built, recipe, short_trace, (Fsdp2(WORLD),))
        assert trace is None
        return note

    assert note_of("every:3") == (
        "full trace: 32 model.layers blocks checkpointed in part would take short traces of "
        "33 blocks in all, more than 60% of them: tracing every block is quicker (plan, "
        "which shares short traces, repeats them)"
    )
    assert traced == []
    assert note_of("every:2").endswith("do not repeat exactly (stopped here)")
    assert traced == ["every:2"]


def test_held_block_inputs_repeat_exactly(tmp_path):
    """``hold_block_inputs`` (FSDP1 under reentrant checkpointing) frees every block's held
    input and gradient together at the end of backward: one free per block, a stretch of
    its own that repeats with the blocks. Nothing a block holds ties its backward to its
    forward, so its module names orient the backward stretch; and the hold costs bytes."""
    engine = Fsdp2(WORLD, hold_block_inputs=True)
    knobs = {"checkpointing": "full", "precision": "amp-bf16"}
    full, repeated = _both(tmp_path, CONFIGS["llama"], engine, **knobs)
    _assert_equal(full, repeated, "repeated blocks: traced 2 and 3 of the 6", 6)
    plain, _ = _both(tmp_path, CONFIGS["llama"], Fsdp2(WORLD), **knobs)
    assert full[0].peak.allocated_bytes > plain[0].peak.allocated_bytes
