"""Beam search's ``reorder_cache`` replayed with the dynamic cache's growth: after every
decode step each layer's keys and values are ``index_select``-ed into a new block of the
same size and the old one freed (transformers' ``DynamicLayer.reorder_cache``)."""

from __future__ import annotations

import json

import pytest

from vramplan import Recipe
from vramplan.pipeline import trace_and_estimate
from vramplan.result import Component
from vramplan.sources import resolve

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("beams") / "config.json"
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": 512,
    }
    path.write_text(json.dumps(config))
    return f"hf:{path}"


def _cache_blocks(llama: str, beams: int) -> list[tuple[str, int]]:
    recipe = Recipe(mode="generate", prompt_len=8, new_tokens=6, num_beams=beams, precision="bf16")
    _, trace = trace_and_estimate(resolve(llama, recipe), recipe)
    return [(a.op, a.nbytes) for a in trace.allocations if a.category == Component.KV_CACHE]


def test_every_grown_block_is_followed_by_its_reordered_copy(llama):
    """Prompt 8, 6 new tokens: the cache grows to 9, 10 and 11 tokens (recorded) and 12
    (real tensors) before the traced last step; with 2 beams each recorded step copies
    all 4 blocks (keys and values of 2 layers) once more, at the size the step left them,
    right after growing them."""
    row = 2 * KV_HEADS * HEAD_DIM * 2  # one token of one block: 2 sequences, bf16
    blocks = _cache_blocks(llama, 2)
    reordered = [size for op, size in blocks if op == "index_select"]
    assert reordered == [row * n for n in (9, 10, 11) for _ in range(2 * LAYERS)]
    for n in (9, 10, 11):
        grown = [i for i, (op, size) in enumerate(blocks) if op == "cat" and size == row * n]
        copied = [
            i for i, (op, size) in enumerate(blocks) if op == "index_select" and size == row * n
        ]
        assert len(grown) == len(copied) == 2 * LAYERS
        assert max(grown) < min(copied)  # the step's cats, then its reorder
    assert not [op for op, _ in _cache_blocks(llama, 1) if op == "index_select"]
