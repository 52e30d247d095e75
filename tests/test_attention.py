"""``--attention``: what each implementation keeps for backward, and where it is refused.

Ground truth: PyTorch's SDPA on real CPU tensors for the fused kernels' numbers, and the
sizes ``flash_api.cpp`` allocates and transformers' eager attention saves, by arithmetic.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from vramplan.errors import UserError
from vramplan.ops.fused_attention import fused_attention
from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe
from vramplan.result import Phase
from vramplan.sources import resolve
from vramplan.trace.policy import policy_for
from vramplan.trace.step import trace_training

LAYERS, HEADS, KV_HEADS, HIDDEN = 1, 4, 2, 64
LLAMA = {
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


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("cfg") / "llama.json"
    path.write_text(json.dumps(LLAMA))
    return f"hf:{path}"


@pytest.mark.parametrize("kernel", ["flash2", "flex"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_fused_kernels_compute_what_sdpa_computes(kernel, kv_heads):
    torch.manual_seed(0)
    q = torch.randn(2, 24, 4, 8, requires_grad=True)
    k = torch.randn(2, 24, kv_heads, 8, requires_grad=True)
    v = torch.randn(2, 24, kv_heads, 8, requires_grad=True)
    out = fused_attention(kernel, q, k, v, causal=True)
    out = out.transpose(1, 2) if kernel == "flex" else out
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref = F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    assert torch.allclose(out, ref, atol=1e-5)
    for mine, theirs in zip(got, want, strict=True):
        assert torch.allclose(mine, theirs, atol=1e-5)


def _saved_by_attention(model: str, attention: str, seq_len: int):
    """Bytes the attention modules allocate in the last forward and keep into backward,
    and the sizes of the fused kernel's outputs."""
    recipe = Recipe(
        batch_size=1, seq_len=seq_len, precision="bf16", optimizer="sgd", attention=attention
    )
    trace = trace_training(resolve(model, recipe), recipe, policy_for("cuda", "sm80"))
    last = max(a.iteration for a in trace.allocations)
    backward = min(
        m.index for m in trace.phases if m.phase == Phase.BACKWARD and m.iteration == last
    )
    kept = [
        a
        for a in trace.allocations
        if a.iteration == last
        and a.phase == Phase.FORWARD
        and "self_attn" in a.module
        and (a.free_index is None or a.free_index > backward)
    ]
    fused = sorted({a.nbytes for a in kept if a.op == "fused_attention_forward"})
    scratch = {
        a.nbytes
        for a in trace.allocations
        if a.iteration == last and a.phase == Phase.BACKWARD and a.op == "new_empty"
    }
    return sum(a.nbytes for a in kept), fused, scratch


def test_flash_keeps_linear_state_where_eager_keeps_quadratic(llama):
    lengths = (32, 64, 128)
    eager = [_saved_by_attention(llama, "eager", s)[0] for s in lengths]
    flash = [_saved_by_attention(llama, "flash_attention_2", s) for s in lengths]
    # kept bytes a + b*S + c*S^2 over S, 2S, 4S: the second difference is 6*c*S^2
    second = lambda t: (t[2] - t[1]) - 2 * (t[1] - t[0])  # noqa: E731
    assert second([f[0] for f in flash]) == 0  # O(S): nothing grows with S^2
    # eager: per layer and head, an fp32 softmax output (4 bytes) and its bf16 copy
    # (2 bytes) for every (query, key) pair, kept for backward
    assert second(eager) == 6 * (LAYERS * HEADS * 6) * lengths[0] ** 2
    # flash_api.cpp mha_fwd: out (B, S, H, D) bf16, softmax_lse (B, H, S) fp32, rng 2 x int64
    head_dim = HIDDEN // HEADS
    for seq_len, (_, fused, scratch) in zip(lengths, flash, strict=True):
        assert fused == sorted({16, HEADS * seq_len * 4, seq_len * HEADS * head_dim * 2})
        # mha_bwd: softmax_d (B, H, S rounded to 128) fp32, dq_accum (B, S rounded to 128,
        # H, head_dim rounded to 32) fp32, dk/dv for every query head (grouped-query)
        rows = -(-seq_len // 128) * 128
        assert {HEADS * rows * 4, rows * HEADS * 32 * 4, seq_len * HEADS * head_dim * 2} <= scratch


def test_flash_refusals(llama, tmp_path):
    with pytest.raises(UserError, match="fp16/bf16 only"):
        resolve(llama, Recipe(attention="flash_attention_2", seq_len=32))
    recipe = Recipe(attention="flash_attention_2", seq_len=32, precision="bf16")
    built = resolve(llama, recipe)
    with pytest.raises(UserError, match="no CPU kernels"):
        estimate_built(built, recipe, "cpu")
    t5 = tmp_path / "t5.json"
    t5.write_text(
        json.dumps(
            {
                "model_type": "t5",
                "architectures": ["T5ForConditionalGeneration"],
                "vocab_size": 128,
                "d_model": 32,
                "d_kv": 8,
                "d_ff": 64,
                "num_layers": 1,
                "num_heads": 4,
            }
        )
    )
    with pytest.raises(UserError, match="does not support --attention flash_attention_2"):
        resolve(f"hf:{t5}", recipe)


def test_amp_flash_casts_like_transformers(llama):
    """Under autocast the projections are already half precision: flash runs."""
    recipe = Recipe(attention="flash_attention_2", seq_len=64, precision="amp-bf16")
    estimate = estimate_built(resolve(llama, recipe), recipe, "cuda")
    assert any("flash_attention_2" in note for note in estimate.notes)
