"""``--mode generate``: the prefill keeps the last position's logits, the KV cache is
2 × layers × KV heads × head dim × dtype bytes per token, the decode peak grows by it, and
the cache matches what a real ``generate`` on the CPU leaves behind."""

from __future__ import annotations

import json

import pytest
import torch

from vramplan import Recipe, Session, UserError
from vramplan.pipeline import trace_and_estimate
from vramplan.sources import resolve
from vramplan.trace.generate import PREFILL

LAYERS, HEADS, HIDDEN, VOCAB = 2, 4, 64, 512
HEAD_DIM = HIDDEN // HEADS


def _llama(kv_heads: int, **extra) -> dict:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 4096,
        **extra,
    }


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    def write(kv_heads: int, **extra) -> str:
        path = tmp_path_factory.mktemp("gen") / "config.json"
        path.write_text(json.dumps(_llama(kv_heads, **extra)))
        return f"hf:{path}"

    return write


def _generation(model: str, **knobs) -> dict:
    return Session(model).estimate(mode="generate", **knobs).details["generation"]


@pytest.mark.parametrize(("kv_heads", "precision", "dtype_bytes"), [(2, "fp32", 4), (1, "bf16", 2)])
def test_kv_cache_bytes_per_token_follow_the_formula(config_path, kv_heads, precision, dtype_bytes):
    """GQA (2 KV heads of 4) in fp32 and MQA (1 KV head) in bf16."""
    model = config_path(kv_heads)
    per_token = 2 * LAYERS * kv_heads * HEAD_DIM * dtype_bytes
    for cache in ("dynamic", "static"):
        g = _generation(
            model, batch_size=3, prompt_len=40, new_tokens=9, precision=precision, cache=cache
        )
        assert g["kv_bytes_per_token"] == per_token
        assert g["kv_cache_bytes"] == 3 * 48 * per_token


def test_the_decode_peak_grows_by_the_cache_of_one_token(config_path):
    """Dynamic cache in bf16 (flash attention, no mask): one more new token adds one
    position to every layer's keys and values, and one more to the block ``torch.cat``
    copies, alive beside the old one at the peak (the last layer's values). A static
    cache grows by one position of every layer, and its decode step by that and the
    attention mask's position (SDPA's bool mask turned into a float one)."""
    model, batch = config_path(2), 2
    row = batch * 2 * HEAD_DIM * 2  # one token of one layer's keys (or values), bf16
    per_token = 2 * LAYERS * row
    runs = {
        cache: [
            _generation(
                model,
                batch_size=batch,
                prompt_len=8,
                new_tokens=n,
                cache=cache,
                precision="bf16",
            )
            for n in (200, 201, 202)
        ]
        for cache in ("static", "dynamic")
    }
    dynamic = [g["decode_peak_bytes"] for g in runs["dynamic"]]
    assert dynamic[1] - dynamic[0] == dynamic[2] - dynamic[1] == per_token + row
    for key in ("kv_cache_bytes", "decode_peak_bytes"):
        static = [g[key] for g in runs["static"]]
        assert static[1] - static[0] == static[2] - static[1]
        mask = 0 if key == "kv_cache_bytes" else batch * (1 + 1 + 4 + 4)  # bool, float
        assert per_token <= static[1] - static[0] <= per_token + mask


def _lm_head_outputs(trace, iteration: int) -> list[int]:
    return [
        a.nbytes
        for a in trace.allocations
        if a.module == "lm_head" and a.iteration == iteration and a.phase == "forward"
    ]


def test_the_prefill_keeps_the_last_positions_logits_only(config_path):
    model, batch, prompt = config_path(2), 2, 48
    recipe = Recipe(mode="generate", batch_size=batch, prompt_len=prompt, new_tokens=4)
    built = resolve(model, recipe)
    assert built.generator.keeps_last_logits  # the forward takes logits_to_keep
    _, trace = trace_and_estimate(built, recipe)
    assert max(_lm_head_outputs(trace, PREFILL)) == batch * 1 * VOCAB * 4
    infer = Recipe(mode="infer", batch_size=batch, seq_len=prompt)
    _, full = trace_and_estimate(resolve(model, infer), infer)
    assert max(_lm_head_outputs(full, 1)) == batch * prompt * VOCAB * 4


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_the_cache_matches_a_real_generate_on_the_cpu(config_path, cache):
    """transformers' own generate, random weights on the CPU: the cache it leaves (storage
    bytes of every layer's keys and values) and the logits its prefill computes."""
    import transformers

    model_name, batch, prompt, new = config_path(2, sliding_window=None), 2, 12, 7
    data = _llama(2)
    config = transformers.LlamaConfig(**{k: v for k, v in data.items() if k != "model_type"})
    model = transformers.LlamaForCausalLM(config).eval()
    shapes = []
    model.lm_head.register_forward_hook(lambda _m, _i, out: shapes.append(tuple(out.shape)))
    ids = torch.randint(0, VOCAB, (batch, prompt))
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            cache_implementation=cache if cache == "static" else None,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    real = sum(
        t.untyped_storage().nbytes()
        for layer in out.past_key_values.layers
        for t in (layer.keys, layer.values)
    )
    assert shapes[0] == (batch, 1, VOCAB)  # generate's prefill: logits_to_keep=1
    assert len(shapes) == new  # the prefill and new - 1 decode steps
    g = _generation(model_name, batch_size=batch, prompt_len=prompt, new_tokens=new, cache=cache)
    assert g["kv_cache_bytes"] == real


def test_a_sliding_window_cache_keeps_its_window(config_path):
    """Mistral-style sliding layers: a real generate's cache storages, window 8."""
    import transformers

    data = {**_llama(2), "model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    data["sliding_window"] = 8
    config = transformers.MistralConfig(**{k: v for k, v in data.items() if k != "model_type"})
    model = transformers.MistralForCausalLM(config).eval()
    ids = torch.randint(0, VOCAB, (1, 20))
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=6,
            min_new_tokens=6,
            do_sample=False,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    real = sum(
        t.untyped_storage().nbytes()
        for layer in out.past_key_values.layers
        for t in (layer.keys, layer.values)
    )
    path = config_path(2)
    with open(path.removeprefix("hf:"), "w") as handle:
        json.dump(data, handle)
    assert _generation(path, prompt_len=20, new_tokens=6)["kv_cache_bytes"] == real


def test_generation_knobs_belong_to_generate_mode():
    with pytest.raises(UserError, match="need --mode generate"):
        Recipe(new_tokens=4)
    with pytest.raises(UserError, match="unknown cache"):
        Recipe(mode="generate", cache="paged")
    with pytest.raises(UserError, match="not a causal language model"):
        Session("torchvision:resnet18").estimate(mode="generate", new_tokens=2)


def test_learned_positions_bound_the_generation(gpt2_config):
    with pytest.raises(UserError, match="64 learned positions"):
        Session(f"hf:{gpt2_config()}").estimate(mode="generate", prompt_len=60, new_tokens=10)


def test_searching_a_generation_needs_generate_mode(config_path):
    with pytest.raises(UserError, match="add --mode generate"):
        Session(config_path(2), gpu="t4").max_batch(search="prompt-len")


def test_a_4bit_decode_step_of_one_sequence_dequantizes_nothing(config_path):
    """bitsandbytes' matmul_4bit: the prefill dequantizes each weight to the compute
    dtype; one row without gradient (a decode step of batch 1) runs gemv_4bit instead."""
    recipe = Recipe(mode="generate", prompt_len=16, new_tokens=3, precision="bf16", quantize="nf4")
    _, trace = trace_and_estimate(resolve(config_path(2), recipe), recipe)
    dequantized = HIDDEN * 128 * 2  # gate_proj's weight in bf16

    def gate(iteration: int) -> list[int]:
        return [
            a.nbytes
            for a in trace.allocations
            if a.module.endswith("mlp.gate_proj") and a.iteration == iteration
        ]

    assert dequantized in gate(PREFILL)
    assert gate(PREFILL + 1) and max(gate(PREFILL + 1)) < dequantized
