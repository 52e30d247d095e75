"""``vramplan serve``: vLLM's start-up accounting on a tiny Llama — weights per rank from
the parameter count written out by hand, the KV cache paged by the formula, and the
budget left after the profile run."""

from __future__ import annotations

import json

import pytest
from conftest import TINY_GEMMA3

import vramplan
from vramplan import UserError

LAYERS, HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 2, 64, 4, 2, 128, 32000
HEAD_DIM = HIDDEN // HEADS
CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": FFN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
# Per layer: q and o (H×H), k and v (H × kv heads × head dim), gate, up, down, two norms.
MATRICES = 2 * VOCAB * HIDDEN + LAYERS * (
    2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV_HEADS * HEAD_DIM + 3 * HIDDEN * FFN
)
VECTORS = LAYERS * 2 * HIDDEN + HIDDEN
SMALL = {"max_num_batched_tokens": 256, "max_num_seqs": 16}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("serve") / "config.json"
    path.write_text(json.dumps(CONFIG))
    return f"hf:{path}"


@pytest.fixture(scope="module")
def plan(model):
    return vramplan.serve(model, gpu="h100", **SMALL)


def test_weights_are_the_parameter_bytes_per_rank(model, plan):
    assert plan.weights_bytes == 2 * (MATRICES + VECTORS)  # bf16
    split = vramplan.serve(model, gpu="h100", tp=2, **SMALL)
    assert split.weights_bytes == 2 * (MATRICES // 2 + VECTORS)  # norms are replicated


def test_the_kv_cache_is_paged_by_the_formula(model, plan):
    per_token = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2
    assert plan.kv_bytes_per_token == per_token
    assert plan.kv_tokens % 16 == 0
    assert plan.kv_tokens * per_token <= plan.kv_cache_bytes < (plan.kv_tokens + 16) * per_token
    assert plan.max_concurrency == pytest.approx(plan.kv_tokens / 4096)
    fp8 = vramplan.serve(model, gpu="h100", kv_cache_dtype="fp8", block_size=32, **SMALL)
    assert fp8.kv_bytes_per_token == per_token // 2
    assert fp8.kv_tokens % 32 == 0
    assert vramplan.serve(model, gpu="h100", tp=2, **SMALL).kv_bytes_per_token == per_token // 2


def test_the_budget_is_the_utilization_share_less_what_the_profile_run_holds(model, plan):
    """Only the requested share moves with the utilization: the profile run does not."""
    lower = vramplan.serve(model, gpu="h100", gpu_memory_utilization=0.5, **SMALL)
    assert plan.total_bytes == lower.total_bytes
    assert plan.kv_cache_bytes - lower.kv_cache_bytes == int(plan.total_bytes * 0.9) - int(
        plan.total_bytes * 0.5
    )
    left = plan.requested_bytes - plan.weights_bytes - plan.non_torch_bytes
    assert plan.kv_cache_bytes == left - plan.activation_peak_bytes


def test_the_profile_run_holds_the_sampled_logits(model, plan):
    """Twice the sequences sampled: at least their fp32 logits, sorted values and int64
    indices and probabilities more (4 + 4 + 8 + 4 bytes per vocabulary entry)."""
    more = vramplan.serve(model, gpu="h100", max_num_batched_tokens=256, max_num_seqs=32)
    assert more.activation_peak_bytes - plan.activation_peak_bytes >= 16 * VOCAB * 20


def test_engine_defaults_follow_the_card(model):
    """vLLM's `serve` defaults: 8192 tokens and 1024 sequences on cards of 70 GiB and up
    except the A100, else 2048 and 256."""
    a10g = vramplan.serve(model, gpu="a10g", max_model_len=1024)
    assert (a10g.options.max_num_batched_tokens, a10g.options.max_num_seqs) == (2048, 256)


def test_a_budget_too_small_for_one_sequence_does_not_start(model, run_cli):
    code, out, _ = run_cli(
        "serve", model, "--gpu", "h100", "--gpu-memory-utilization", "0.0001", "--json"
    )
    data = json.loads(out)
    assert code == 3 and data["fits"] is False and data["kv_tokens"] == 0
    assert data["largest_max_model_len"] == 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
        (["--kv-cache-dtype", "int3"], "unknown --kv-cache-dtype"),
        (["--tp", "3"], "does not divide"),
        (["--engine", "tgi"], "unknown engine"),
    ],
)
def test_bad_serve_flags_are_one_line(model, run_cli, flags, message):
    code, _, err = run_cli("serve", model, "--gpu", "h100", *flags)
    assert code == 2 and message in err and "Traceback" not in err


def test_serve_needs_a_card(model, run_cli):
    code, _, err = run_cli("serve", model)
    assert code == 2 and "--gpu" in err
    with pytest.raises(UserError, match="not a causal language model"):
        vramplan.serve("torchvision:resnet18", gpu="h100")


def test_a_vision_language_model_serves_its_text_stacks_positions(tmp_path):
    """vLLM's default max_model_len is the text stack's positions (Gemma 3: 131072), which
    a vision-language config holds in its text config, not at its top level."""
    path = tmp_path / "config.json"
    text = {**TINY_GEMMA3["text_config"], "max_position_embeddings": 1536}
    path.write_text(json.dumps({**TINY_GEMMA3, "text_config": text}))
    served = vramplan.serve(f"hf:{path}", gpu="h100", **SMALL)
    assert served.options.max_model_len == 1536
