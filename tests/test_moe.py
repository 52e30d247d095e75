"""Mixture-of-experts layers traced under a stated routing policy.

The policy is the specification: ``expert_loads`` says how many tokens each expert gets,
and the traced per-expert loop must allocate exactly those rows."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from torch import nn

from vramplan.errors import UserError
from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe
from vramplan.result import Phase
from vramplan.sources import resolve
from vramplan.sources.hf_moe import expert_loads, register
from vramplan.sources.hf_moe_linear import LinearExpertsBlock
from vramplan.sources.quantized import QuantizedLinear, layout_4bit
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


def _built(tmp_path, experts: str | None, **knobs):
    recipe = Recipe(seq_len=32, precision="bf16", experts=experts, **knobs)
    return resolve(_config(tmp_path, MIXTRAL), recipe).model


def test_linear_experts_hold_the_same_parameters_as_transformers_5(tmp_path):
    grouped = _built(tmp_path, None)
    linear = _built(tmp_path, "linear")
    assert sum(p.numel() for p in linear.parameters()) == sum(
        p.numel() for p in grouped.parameters()
    )
    names = {name for name, _ in linear.named_parameters()}
    assert "model.layers.0.mlp.experts.3.w2.weight" in names
    assert "model.layers.0.mlp.gate.weight" in names


def test_nf4_reaches_every_expert_linear_and_the_router(tmp_path):
    model = _built(tmp_path, "linear", quantize="nf4", double_quant=True)
    block = model.model.layers[0].mlp
    expected = {(INTER, HIDDEN): 2 * EXPERTS, (HIDDEN, INTER): EXPERTS, (EXPERTS, HIDDEN): 1}
    seen: dict[tuple[int, int], int] = {}
    for layer in block.modules():
        if isinstance(layer, nn.Linear):
            assert isinstance(layer, QuantizedLinear) and layer.scheme == "nf4"
            shape = (layer.out_features, layer.in_features)
            seen[shape] = seen.get(shape, 0) + 1
            layout = layout_4bit(*shape, double_quant=True)
            assert layer.stored_bytes() == sum(
                math.prod(size) * torch.empty((), dtype=dtype).element_size()
                for size, dtype in layout.values()
            )
    assert seen == expected


def test_linear_experts_compute_what_the_5x_loop_computes(tmp_path):
    """A real CPU forward and backward: 4.48's block with the 5.x block's weights (w1 and w3
    the halves of gate_up_proj, w2 down_proj, the router's weight the gate's) gives the
    same output and input gradient under the same routing policy."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    register(transformers)
    config = MixtralConfig(**{k: v for k, v in MIXTRAL.items() if k != "architectures"})
    config._experts_implementation = "vramplan_eager_balanced"
    torch.manual_seed(0)
    grouped = MixtralSparseMoeBlock(config)
    for param in grouped.parameters():
        nn.init.normal_(param, std=0.1)
    linear = LinearExpertsBlock(config, "balanced", device="cpu")
    with torch.no_grad():
        linear.gate.weight.copy_(grouped.gate.weight)
        for index, expert in enumerate(linear.experts):
            w1, w3 = grouped.experts.gate_up_proj[index].chunk(2, dim=0)
            expert.w1.weight.copy_(w1)
            expert.w3.weight.copy_(w3)
            expert.w2.weight.copy_(grouped.experts.down_proj[index])
    outputs, grads = [], []
    for block in (grouped, linear):
        x = torch.randn(2, 8, HIDDEN, generator=torch.Generator().manual_seed(1))
        x.requires_grad_(True)
        out = block(x)
        out.square().sum().backward()
        outputs.append(out.detach())
        grads.append(x.grad)
    torch.testing.assert_close(outputs[0], outputs[1])
    # the input gradient sums w1's and w3's parts apart, not in one fused matmul: fp32
    # rounding of a different summation order
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-4)


def test_linear_experts_refuse_other_families(tmp_path):
    with pytest.raises(UserError, match="no Mixtral experts block"):
        resolve(_config(tmp_path, QWEN2_MOE), Recipe(experts="linear"))


@pytest.mark.parametrize("precision", ["fp32", "amp-bf16"])
def test_fp32_grouped_experts_are_refused_in_one_line_naming_what_runs(
    tmp_path, run_cli, precision
):
    """PyTorch's grouped matmul takes bf16/fp16 only (``_meta_grouped_mm_common`` mirrors
    ``_grouped_mm_cuda``) and has no autocast rule (transformers#43828), so fp32 weights
    fail with or without autocast; the line says what runs: bf16 or the eager experts."""
    spec = _config(tmp_path, MIXTRAL)
    code, out, err = run_cli("estimate", spec, "-s", "16", "-p", precision)
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert "--precision bf16" in err and "--experts eager" in err and "autocast" in err
    assert run_cli("estimate", spec, "-s", "16", "-p", precision, "--experts", "eager")[0] == 0


def test_fp16_grouped_experts_are_refused_in_one_line_naming_what_runs(tmp_path, run_cli):
    """PyTorch runs fp16 ``grouped_mm`` only through cuBLASLt's grouped GEMM (CUDA 13.3+ on
    sm90-sm11x; ``_meta_registrations``), so an fp16 step of transformers' default experts
    fails on other stacks; the line says so, and bf16 or ``--experts eager`` runs."""
    spec = _config(tmp_path, MIXTRAL)
    code, out, err = run_cli("estimate", spec, "-s", "16", "-p", "fp16", "--mode", "infer")
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert "CUDA 13.3" in err and "--precision bf16" in err
    for flags in (["-p", "bf16"], ["-p", "fp16", "--experts", "eager"]):
        assert run_cli("estimate", spec, "-s", "16", "--mode", "infer", *flags)[0] == 0
