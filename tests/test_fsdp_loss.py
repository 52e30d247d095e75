"""The chunked and fused causal-LM losses under FSDP2 (issue 15): computed inside the root's
forward, where FSDP2 has gathered the embeddings and head they use. The chunking saves the
same saved logits on a rank as on one GPU, and PyTorch's own FSDPMemTracker measures the
traced rank's peak."""

from __future__ import annotations

import json

import pytest
from conftest import fsdp_peaks

from vramplan.device.options import device_options
from vramplan.distributed.fsdp import Fsdp2
from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe
from vramplan.sources import resolve

WORLD = 2
VOCAB, BATCH, SEQ = 32000, 2, 64


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_fsdp_loss") / "config.json"
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 256,
    }
    path.write_text(json.dumps(config))
    return f"hf:{path}"


def _recipe(**changes):
    return Recipe(batch_size=BATCH, seq_len=SEQ, precision="fp32", optimizer="adamw", **changes)


def _estimate(spec, recipe, engine=None):
    device = device_options(gpu="h100", data_parallel=engine.world_size if engine else 1)
    return estimate_built(resolve(spec, recipe), recipe, "cuda", device, engine=engine)


@pytest.fixture(scope="module")
def runs(spec):
    return {
        (name, sharded): _estimate(spec, _recipe(**changes), Fsdp2(WORLD) if sharded else None)
        for name, changes in (("plain", {}), ("chunked", {"loss_chunks": 8}))
        for sharded in (False, True)
    }


def test_chunking_saves_the_same_logits_on_a_rank(runs):
    logits = VOCAB * BATCH * SEQ * 4  # the fp32 [batch, seq, vocab] logits

    def saved(sharded):
        plain, chunked = runs["plain", sharded], runs["chunked", sharded]
        return plain.components["activations"] - chunked.components["activations"]

    # at the peak (backward), the whole logits are no longer kept for backward: as many
    # saved bytes fewer on a rank of FSDP2 as on one GPU
    assert saved(True) == saved(False) >= logits
    sharded_saving = (
        runs["plain", True].peak.allocated_bytes - runs["chunked", True].peak.allocated_bytes
    )
    assert sharded_saving > logits / 2
    assert any("FSDP2 traced as rank 0 of 2" in n for n in runs["chunked", True].notes)


def test_fused_loss_under_fsdp(spec, runs):
    fused = _estimate(spec, _recipe(fused_ce=True), Fsdp2(WORLD))
    assert fused.peak.allocated_bytes < runs["plain", True].peak.allocated_bytes
    # the rank keeps its shards of every state, as without the fused loss
    key = "optimizer_state_bytes"
    assert fused.details[key] == runs["plain", True].details[key]


def test_traced_chunked_rank_equals_pytorchs_fsdp_mem_tracker(spec):
    """PyTorch's own FSDPMemTracker on the same sharded model, fake tensors and fake process
    group, running the chunked loss step, measures the peak our trace of that rank gives."""
    ours, theirs = fsdp_peaks(spec, _recipe(loss_chunks=8), WORLD)
    print(f"traced {ours:,} B, FSDPMemTracker {theirs:,} B")
    assert ours == pytest.approx(theirs, rel=0.005)
