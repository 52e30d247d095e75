"""``--cache quanto|hqq|fp8``: transformers' ``QuantizedCache`` in ``--mode generate``. The
bytes per token are the packed values plus a scale and a zero per group in the cache's
dtype (quanto, hqq) or one fp8 byte a value (fp8); after the last decode step the cache
holds the quantized tokens and the full-precision residual transformers' update leaves."""

from __future__ import annotations

import json

import pytest

from vramplan import Session

LAYERS, HEADS, KV_HEADS, HIDDEN = 2, 4, 2, 64
HEAD_DIM = HIDDEN // HEADS
VALUES = 2 * LAYERS * KV_HEADS * HEAD_DIM  # cached values per token (keys and values)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("kvq") / "config.json"
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 256,
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": 4096,
    }
    path.write_text(json.dumps(config))
    return f"hf:{path}"


def _generation(model: str, **knobs) -> dict:
    estimate = Session(model).estimate(mode="generate", precision="bf16", **knobs)
    return estimate.details["generation"]


@pytest.mark.parametrize(
    ("cache", "bits", "group", "per_token"),
    [
        ("quanto", 4, 64, VALUES // 2 + VALUES // 64 * 2 * 2),
        ("quanto", 2, 32, VALUES // 4 + VALUES // 32 * 2 * 2),
        ("hqq", 4, 64, VALUES // 2 + VALUES // 64 * 2 * 2),
        ("fp8", None, None, VALUES),
    ],
)
def test_quantized_cache_bytes_per_token(llama, cache, bits, group, per_token):
    knobs = {} if cache == "fp8" else {"kv_bits": bits, "kv_group_size": group}
    g = _generation(llama, prompt_len=64, new_tokens=2, cache=cache, **knobs)
    # fp8 keeps one fp32 scale per tensor beside its values: 2 per layer, not per token
    scales = 2 * LAYERS * 4 if cache == "fp8" else 0
    assert g["kv_bytes_per_token"] == (64 * per_token + scales) // 64
    assert per_token < 2 * VALUES  # smaller than the bf16 cache


@pytest.mark.parametrize(("new_tokens", "residual"), [(20, 3), (25, 0)])
def test_after_the_last_step_the_residual_holds_what_transformers_leaves(
    llama, new_tokens, residual
):
    """Residual window 8: the prompt is quantized; every decode step adds a token to the
    residual and the step that brings it to 8 quantizes all. After the last of
    ``new_tokens - 1`` steps, ``(new_tokens - 1) % 8`` tokens stay in bf16."""
    prompt, window = 32, 8
    g = _generation(
        llama, prompt_len=prompt, new_tokens=new_tokens, cache="quanto", kv_residual_length=window
    )
    seen = prompt + new_tokens - 1
    packed = (seen - residual) * (VALUES // 2 + VALUES // 64 * 2 * 2)
    assert g["kv_cache_bytes"] == packed + residual * VALUES * 2


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-bits", "2"], "need --cache quanto|hqq"),
        (["--cache", "quanto", "--kv-bits", "3"], "takes 2, 4"),
        (["--cache", "hqq", "--kv-group-size", "0"], "positive integer"),
    ],
)
def test_bad_kv_flags_are_one_line(llama, run_cli, flags, message):
    code, _, err = run_cli("estimate", llama, "--mode", "generate", "--prompt-len", "8", *flags)
    assert code == 2
    assert message in err and "Traceback" not in err
