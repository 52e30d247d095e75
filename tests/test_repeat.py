"""Repeated blocks traced once: the rebuilt trace equals the full trace, event for event."""

from __future__ import annotations

import json

import pytest
from conftest import assert_same_estimate

from vramplan.device.options import device_options
from vramplan.pipeline import trace_and_estimate
from vramplan.recipe import Recipe
from vramplan.sources import resolve

CONFIGS = {
    "gpt2": {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": 512,
        "n_positions": 64,
        "n_embd": 64,
        "n_layer": 6,
        "n_head": 2,
    },
    "bert": {
        "model_type": "bert",
        "architectures": ["BertForMaskedLM"],
        "vocab_size": 512,
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 2,
        "intermediate_size": 128,
        "max_position_embeddings": 64,
    },
    "vit": {
        "model_type": "vit",
        "architectures": ["ViTForImageClassification"],
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 2,
        "intermediate_size": 128,
        "image_size": 32,
        "patch_size": 8,
        "num_labels": 10,
    },
    "llama": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
    },
}
# Tied input/output embeddings: no lm_head parameter, so the final norm's gradient (a 1-D
# ``sum`` like a block norm's) ends every per-parameter list right after the last block.
CONFIGS["llama-tied"] = {**CONFIGS["llama"], "tie_word_embeddings": True}


@pytest.fixture(autouse=True)
def _short_runs_repeat_too(monkeypatch):
    """The tiny models here have 6 blocks; repetition's threshold is a speed policy."""
    monkeypatch.setattr("vramplan.trace.repeat.MIN_BLOCKS", 5)


def _both(tmp_path, kind: str, **knobs):
    path = tmp_path / f"{kind}.json"
    path.write_text(json.dumps(CONFIGS[kind]))
    recipe = Recipe(batch_size=2, seq_len=None if kind == "vit" else 32, **knobs)
    device = device_options(gpu="a100-80gb")
    results = []
    for repeat in (False, True):
        built = resolve(f"hf:{path}", recipe)
        built.repeat_blocks = repeat
        results.append(trace_and_estimate(built, recipe, "cuda", device))
    return results


def _assert_equal(full, repeated) -> None:
    assert_same_estimate(full, repeated)
    assert repeated[0].model == full[0].model


@pytest.mark.parametrize(
    ("kind", "knobs"),
    [
        ("gpt2", {}),
        ("bert", {}),
        ("vit", {}),
        ("llama", {}),
        ("llama", {"precision": "bf16"}),
        ("llama", {"checkpointing": "full"}),
        ("llama", {"checkpointing": "full", "precision": "amp-bf16"}),
        ("llama", {"optimizer": "adam", "grad_accum": 4}),
        # autocast's casts, a KV cache's frees between forward and backward, inference:
        ("llama", {"precision": "amp-bf16"}),
        ("llama", {"optimizer": "sgd", "precision": "amp-bf16"}),
        ("llama", {"mode": "infer"}),
        ("llama", {"mode": "infer", "precision": "bf16"}),
        ("llama", {"checkpointing": "full", "precision": "bf16"}),
        ("gpt2", {"precision": "amp-bf16"}),
        ("gpt2", {"mode": "infer"}),
        ("llama-tied", {}),
        ("llama-tied", {"precision": "bf16"}),
        ("llama-tied", {"precision": "amp-bf16"}),
        ("llama-tied", {"checkpointing": "full"}),
        ("llama-tied", {"optimizer": "sgd"}),
        ("llama-tied", {"mode": "infer"}),
        ("llama", {"activation_offload": True}),
    ],
)
def test_repeated_blocks_equal_the_full_trace(tmp_path, kind, knobs):
    full, repeated = _both(tmp_path, kind, **knobs)
    assert any(n.startswith("repeated blocks: traced 2 and 3 of the 6") for n in repeated[0].notes)
    _assert_equal(full, repeated)


@pytest.mark.parametrize(
    "knobs",
    [
        {"checkpointing": "2"},  # checkpointed and plain blocks mixed
    ],
)
def test_falls_back_to_the_full_trace_and_says_so(tmp_path, knobs):
    full, repeated = _both(tmp_path, "llama", **knobs)
    assert any(n.startswith("full trace: 6 model.layers blocks") for n in repeated[0].notes)
    _assert_equal(full, repeated)


def test_offloading_checkpointed_blocks_falls_back_and_says_why(tmp_path):
    # The offloader's forward stash keeps a checkpointed block's input on the card for
    # FORWARD_STASH blocks: deeper than the short traces, so the fallback is the exact answer.
    full, repeated = _both(tmp_path, "llama", checkpointing="full", activation_offload=True)
    note = "full trace: 6 model.layers blocks do not repeat exactly (with --activation-offload"
    assert any(n.startswith(note) for n in repeated[0].notes), repeated[0].notes
    _assert_equal(full, repeated)


def test_offloaded_checkpointed_blocks_repeat_with_a_stash_of_one(tmp_path, monkeypatch):
    # With a one-tensor stash each block's input dies in the next block, and the repeat is
    # exact; nothing a block keeps on the card ties its backward to its forward, so the
    # backward stretch is oriented by its module names (last block first).
    monkeypatch.setattr("vramplan.trace.tricks.FORWARD_STASH", 1)
    full, repeated = _both(tmp_path, "llama", checkpointing="full", activation_offload=True)
    assert any(n.startswith("repeated blocks: traced 2 and 3 of the 6") for n in repeated[0].notes)
    _assert_equal(full, repeated)


def test_full_trace_flag(run_cli, tmp_path):
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(CONFIGS["llama"]))
    out = {}
    for flags in ((), ("--full-trace",)):
        code, text, _ = run_cli("estimate", f"hf:{path}", "--seq-len", "32", "--json", *flags)
        assert code == 0
        out[flags] = json.loads(text)
    assert out[()]["peak"] == out[("--full-trace",)]["peak"]
    assert any("repeated blocks" in n for n in out[()]["notes"])
    assert not any("repeated blocks" in n for n in out[("--full-trace",)]["notes"])


GEMMA2 = {
    "model_type": "gemma2",
    "architectures": ["Gemma2ForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "sliding_window": 16,
    "max_position_embeddings": 128,
}


def test_blocks_that_are_not_alike_are_traced_whole_and_the_notes_say_why(tmp_path):
    """Gemma 2 alternates sliding-window and global attention layers, so no two neighbours
    are alike: 6 blocks, 3 patterns of 2, are too few to repeat; they are traced whole,
    and the note says how many in a row were alike and how the blocks repeat."""
    path = tmp_path / "gemma2.json"
    path.write_text(json.dumps(GEMMA2))
    recipe = Recipe(batch_size=2, seq_len=32)
    estimate, _ = trace_and_estimate(
        resolve(f"hf:{path}", recipe), recipe, "cuda", device_options(gpu="a100-80gb")
    )
    unlike = (
        "full trace: the 6 model.layers blocks are not alike (at most 1 identical in a row; "
        "runs of 5 or more are traced once and repeated) (they repeat every 2 blocks"
    )
    assert any(note.startswith(unlike) for note in estimate.notes)


@pytest.mark.parametrize("knobs", [{}, {"checkpointing": "full", "precision": "amp-bf16"}])
def test_blocks_that_repeat_in_pairs_are_rebuilt_in_units_of_two(tmp_path, monkeypatch, knobs):
    """10 Gemma 2 layers are 5 pairs of a sliding-window and a global one: traced as 2, 3
    and 4 pairs and rebuilt, they equal the full trace."""
    monkeypatch.setattr("vramplan.trace.repeat.PERIODS", 5)
    path = tmp_path / "gemma2.json"
    path.write_text(json.dumps({**GEMMA2, "num_hidden_layers": 10}))
    recipe = Recipe(batch_size=2, seq_len=32, **knobs)
    results = []
    for repeat in (False, True):
        built = resolve(f"hf:{path}", recipe)
        built.repeat_blocks = repeat
        results.append(trace_and_estimate(built, recipe, "cuda", device_options(gpu="h100")))
    full, repeated = results
    assert any("stretches of 5 units of 2 blocks" in note for note in repeated[0].notes)
    _assert_equal(full, repeated)


def test_an_encoder_decoder_is_traced_whole_rather_than_its_decoder_three_times(tmp_path):
    """Each short trace of T5's encoder stack would run the whole decoder stack too: one
    trace of the whole model costs less (``_whole_is_cheaper``), and the note says so."""
    path = tmp_path / "t5.json"
    t5 = {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "vocab_size": 96}
    t5 |= {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 7, "num_heads": 4}
    path.write_text(json.dumps({**t5, "decoder_start_token_id": 0, "pad_token_id": 0}))
    recipe = Recipe(batch_size=2, seq_len=16)
    built = resolve(f"hf:{path}", recipe)
    estimate = trace_and_estimate(built, recipe, "cuda", device_options(gpu="a100-80gb"))
    assert any("would also run the rest of the model" in note for note in estimate[0].notes)
    assert not any(note.startswith("repeated blocks") for note in estimate[0].notes)
