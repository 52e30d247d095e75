"""``max-batch`` and ``plan`` under the user's parallel layout (``--fsdp N``, ``--zero N``,
a ``--config`` naming one): each judges one rank as ``estimate`` does under the same
flags, and ``plan`` starts from the layout instead of proposing it again."""

from __future__ import annotations

import json

import pytest

import vramplan
from vramplan.report.plan import render_max_batch

# logits of a 32000-token vocabulary decide each sample's bytes; two narrow blocks
TINY = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 32000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
# 131M parameters in the embeddings and the head: fp32 AdamW's states dominate the step
WIDE = {**TINY, "hidden_size": 2048, "intermediate_size": 256}
FSDP_STEP = ("--seq-len", "64", "--gpu-memory", "1.4GiB", "--fsdp", "2")
WIDE_CARD = "4.235GiB"


def _model(tmp_path_factory, name: str, config: dict) -> str:
    path = tmp_path_factory.mktemp(name) / "config.json"
    path.write_text(json.dumps(config))
    return f"hf:{path}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return _model(tmp_path_factory, "tiny", TINY)


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> str:
    return _model(tmp_path_factory, "wide", WIDE)


def _json(run_cli, *args: str) -> dict:
    code, out, err = run_cli(*args, "--json")
    assert code == 0, err
    return json.loads(out)


def test_max_batch_under_fsdp_is_what_estimate_says(run_cli, tiny):
    """The per-GPU batch N of ``--fsdp 2``: ``estimate`` under the same flags fits at N, to
    the byte of the search's figure, and does not at N + 1."""
    found = _json(run_cli, "max-batch", tiny, *FSDP_STEP, "--jobs", "1")
    n = found["max_batch_size"]
    assert found["estimate"]["details"]["parallel"]["layout"] == "fsdp dp=2"
    at_n = _json(run_cli, "estimate", tiny, *FSDP_STEP, "--batch-size", str(n))
    beyond = _json(run_cli, "estimate", tiny, *FSDP_STEP, "--batch-size", str(n + 1))
    assert at_n["verdict"]["status"] == "fits" and beyond["verdict"]["status"] != "fits"
    assert at_n["peak"]["device_total_bytes"] == found["estimate"]["peak"]["device_total_bytes"]
    assert beyond["peak"]["device_total_bytes"] == found["next"]["device_total_bytes"]


def test_sharding_the_states_makes_room_for_a_larger_batch(wide, capsys):
    """ZeRO-3 over 4 GPUs holds a quarter of the optimizer state per rank: the per-GPU
    batch grows past the single GPU's (the formula layout reuses the single-GPU traces)."""
    session = vramplan.Session(wide, gpu_memory=WIDE_CARD, jobs=1)
    recipe = vramplan.Recipe(seq_len=64)
    layout = vramplan.parallel_layout(zero=3, dp=4)
    single = session.max_batch(recipe)
    sharded = session.max_batch(recipe, layout=layout)
    assert sharded.value > single.value
    rank = sharded.estimate.details["parallel"]
    assert rank["model_state_bytes_per_gpu"] < single.estimate.model.parameter_bytes * 4
    beyond = session.estimate(recipe.with_changes(batch_size=sharded.value + 1), layout=layout)
    assert beyond.verdict.status != "fits"
    assert beyond.peak.device_total_bytes == sharded.beyond.peak.device_total_bytes
    render_max_batch(sharded, "binary")
    said = " ".join(capsys.readouterr().out.split())
    assert f"per-GPU batch size that fits each custom ({WIDE_CARD}) of zero3 dp=4" in said


def test_a_config_layout_reaches_max_batch(run_cli, wide, tmp_path):
    """A DeepSpeed file's ZeRO stage and GPU count are the search's layout, not a line
    saying they were not applied."""
    ds = tmp_path / "ds.json"
    ds.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 1,
                "gradient_accumulation_steps": 1,
                "train_batch_size": 4,
                "zero_optimization": {"stage": 3},
            }
        )
    )
    card = ("--seq-len", "64", "--gpu-memory", WIDE_CARD, "--jobs", "1")
    from_file = _json(run_cli, "max-batch", wide, "--config", str(ds), *card)
    from_flags = _json(run_cli, "max-batch", wide, "--zero", "3", "--dp", "4", *card)
    assert from_file["estimate"]["details"]["parallel"]["layout"] == "zero3 dp=4"
    assert from_file["max_batch_size"] == from_flags["max_batch_size"]
    assert not any("not applied" in line for line in from_file["config"])


@pytest.mark.parametrize(
    ("layout", "proposed"),
    [
        (("--fsdp", "2"), None),  # full sharding already: nothing further on 2 GPUs
        (("--world-size", "2", "--shard", "grad-op"), "--fsdp 2"),
    ],
)
def test_plan_starts_from_the_layout(run_cli, tiny, layout, proposed):
    """The baseline and every lever are one rank's; FSDP is not proposed again, and a
    grad-op run is offered full sharding on its own GPUs, judged as estimate judges it."""
    step = ("--seq-len", "64", "--batch-size", "2", "--gpu-memory", "1.4GiB")
    lean = ("--mode", "infer", "--precision", "bf16", "--optimizer", "sgd", "--jobs", "1")
    answer = _json(run_cli, "plan", tiny, *step, *lean, *layout)
    described = "fsdp dp=2" if proposed is None else "fsdp-grad-op dp=2"
    assert answer["estimate"]["details"]["parallel"]["layout"] == described
    assert any(f"one rank's of {described}" in note for note in answer["notes"])
    sharding = [lever for lever in answer["levers"] if "--fsdp" in lever["flags"]]
    if proposed is None:
        assert sharding == []
        return
    (lever,) = sharding
    assert lever["flags"] == proposed and lever["changes"] == {}
    full = _json(run_cli, "estimate", tiny, *step, *lean[:-2], *proposed.split())
    assert lever["peak"]["device_total_bytes"] == full["peak"]["device_total_bytes"]
    base = answer["estimate"]["peak"]["device_total_bytes"]
    assert lever["saved_bytes"] == base - full["peak"]["device_total_bytes"]


def test_plan_under_fsdp_offers_the_chunked_loss(run_cli, tiny):
    """Under ``--fsdp 2`` the chunked loss is a lever (it runs inside FSDP2's root forward):
    one rank's figures, as ``estimate --fsdp 2 --loss-chunks 8`` gives them, below the
    baseline's allocated peak by at least half the fp32 logits it no longer keeps whole."""
    step = ("--seq-len", "64", "--batch-size", "2", "--gpu-memory", "1.4GiB", "--fsdp", "2")
    answer = _json(run_cli, "plan", tiny, *step, "--jobs", "1")
    (lever,) = [lever for lever in answer["levers"] if lever["name"] == "chunked loss"]
    assert lever["changes"] == {"loss_chunks": 8}
    chunked = _json(run_cli, "estimate", tiny, *step, "--loss-chunks", "8")
    assert lever["peak"] == chunked["peak"]
    logits = TINY["vocab_size"] * 2 * 64 * 4
    saved = answer["estimate"]["peak"]["allocated_bytes"] - chunked["peak"]["allocated_bytes"]
    assert saved > logits / 2
