"""Mixture-of-experts layers traced under a stated routing policy.

The policy is the specification: ``expert_loads`` says how many tokens each expert gets,
and the traced per-expert loop must allocate exactly those rows."""

from __future__ import annotations

import json

import pytest

from vramplan.errors import UserError
from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe
from vramplan.result import Phase
from vramplan.sources import resolve
from vramplan.sources.hf_moe import expert_loads
from vramplan.trace.policy import policy_for
from vramplan.trace.step import trace_training

HIDDEN, INTER, EXPERTS, TOP_K = 64, 96, 4, 2
MIXTRAL = {
    "model_type": "mixtral",
    "architectures": ["MixtralForCausalLM"],
    "vocab_size": 128,
    "hidden_size": HIDDEN,
    "intermediate_size": INTER,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": EXPERTS,
    "num_experts_per_tok": TOP_K,
}
QWEN2_MOE = {
    "model_type": "qwen2_moe",
    "architectures": ["Qwen2MoeForCausalLM"],
    "vocab_size": 128,
    "hidden_size": HIDDEN,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": EXPERTS,
    "num_experts_per_tok": TOP_K,
}


def _config(tmp_path, data) -> str:
    path = tmp_path / f"{data['model_type']}.json"
    path.write_text(json.dumps(data))
    return f"hf:{path}"


@pytest.mark.parametrize("tokens,top_k,experts", [(10, 2, 8), (7, 3, 5), (64, 1, 4)])
def test_expert_loads_keep_the_routers_row_count(tokens, top_k, experts):
    balanced = expert_loads(tokens, top_k, experts, "balanced")
    worst = expert_loads(tokens, top_k, experts, "worst")
    assert sum(balanced) == sum(worst) == tokens * top_k
    assert max(balanced) - min(balanced) <= 1
    assert max(worst) == tokens  # a token picks an expert at most once
    assert sum(1 for n in worst if n) == top_k


def _expert_rows(model: str, routing: str, tokens: int) -> list[int]:
    """Rows of each gate_up projection the experts computed in the first forward."""
    recipe = Recipe(
        seq_len=tokens, precision="bf16", mode="infer", experts="eager", moe_routing=routing
    )
    trace = trace_training(resolve(model, recipe), recipe, policy_for("cuda", "sm80"))
    width = 2 * INTER * 2  # gate and up, bf16
    return sorted(
        a.nbytes // width
        for a in trace.allocations
        if a.module.endswith("mlp.experts")
        and a.phase == Phase.FORWARD
        and a.iteration == 1
        and a.op == "mm"
        and a.nbytes % width == 0
        and a.nbytes // width in expert_loads(tokens, TOP_K, EXPERTS, routing)
    )


@pytest.mark.parametrize("routing", ["balanced", "worst"])
def test_each_expert_computes_the_rows_the_policy_gives_it(tmp_path, routing):
    model = _config(tmp_path, MIXTRAL)
    tokens = 48
    loads = [n for n in expert_loads(tokens, TOP_K, EXPERTS, routing) if n]
    assert _expert_rows(model, routing, tokens) == sorted(loads)


def test_worst_routing_needs_more_than_balanced(tmp_path):
    model = _config(tmp_path, MIXTRAL)
    peaks = {}
    for routing in ("balanced", "worst"):
        recipe = Recipe(
            seq_len=256, precision="bf16", mode="infer", experts="eager", moe_routing=routing
        )
        estimate = estimate_built(resolve(model, recipe), recipe, "cuda")
        peaks[routing] = estimate.peak.allocated_bytes
        assert any(f"{routing} routing" in note for note in estimate.notes)
    assert peaks["worst"] > peaks["balanced"]


def test_other_families_trace_with_the_loop_and_refusals(tmp_path):
    recipe = Recipe(seq_len=32, precision="bf16", experts="eager", moe_routing="worst")
    estimate = estimate_built(resolve(_config(tmp_path, QWEN2_MOE), recipe), recipe, "cuda")
    assert estimate.peak.allocated_bytes > 0
    dense = dict(MIXTRAL, model_type="mistral", architectures=["MistralForCausalLM"])
    del dense["num_local_experts"], dense["num_experts_per_tok"]
    with pytest.raises(UserError, match="no mixture of experts"):
        resolve(_config(tmp_path, dense), Recipe(experts="eager"))
