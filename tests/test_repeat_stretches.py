"""Block repetition where the blocks are not all alike once the recipe is applied (some
checkpointed, some not): the rebuilt trace equals the full trace, event for event."""

from __future__ import annotations

import json

import pytest
from conftest import assert_same_estimate, gqa_llama

from vramplan.device.options import device_options
from vramplan.pipeline import trace_and_estimate
from vramplan.recipe import Recipe
from vramplan.sources import resolve


@pytest.fixture(autouse=True)
def _short_runs_repeat_too(monkeypatch):
    """The tiny model here has 10 blocks; repetition's thresholds are a speed policy."""
    monkeypatch.setattr("vramplan.trace.repeat.MIN_BLOCKS", 5)
    monkeypatch.setattr("vramplan.trace.repeat.SHORTER", 10.0)


def _both(tmp_path, layers: int, **knobs):
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(gqa_llama(layers)))
    recipe = Recipe(batch_size=2, seq_len=32, **knobs)
    device = device_options(gpu="a100-80gb")
    results = []
    for repeat in (False, True):
        built = resolve(f"hf:{path}", recipe)
        built.repeat_blocks = repeat
        results.append(trace_and_estimate(built, recipe, "cuda", device))
    return results


def test_every_second_block_checkpointed(tmp_path):
    """One stretch whose unit is two blocks (a plain one, then a checkpointed one)."""
    full, repeated = _both(tmp_path, 10, checkpointing="every:2", precision="amp-bf16")
    note = "repeated blocks: the 10 model.layers blocks are stretches of 5 units of 2 blocks"
    assert_same_estimate(full, repeated, note)
