"""GPTQ and AWQ int4 checkpoints (``--quantize gptq|awq``): the stored bytes are 4 bits a
weight plus fp16 scales and 4-bit zeros per group (and GPTQ's int32 ``g_idx``), as
GPT-QModel registers them; the kernels keep and allocate what their sources do (Marlin's
fp32 reduction buffer per call, AWQ GEMM's dequantized copy above 1024 rows, the
exllamav2 scratch sized by the largest layer)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import vramplan
from vramplan import Recipe
from vramplan.pipeline import trace_and_estimate
from vramplan.result import Component
from vramplan.sources import resolve
from vramplan.sources.int4 import SMS, Int4Format, PackedInt4Linear
from vramplan.trace.generate import DECODE, PREFILL

LAYERS, HIDDEN, INTER, VOCAB, HEADS, KV_HEADS = 2, 128, 256, 512, 4, 2
HEAD_DIM = HIDDEN // HEADS
# (in, out) of every linear of one decoder layer: q, k, v, o, gate, up, down
LINEARS = [
    (HIDDEN, HIDDEN),
    (HIDDEN, KV_HEADS * HEAD_DIM),
    (HIDDEN, KV_HEADS * HEAD_DIM),
    (HIDDEN, HIDDEN),
    (HIDDEN, INTER),
    (HIDDEN, INTER),
    (INTER, HIDDEN),
]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("int4") / "config.json"
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": 4096,
    }
    path.write_text(json.dumps(config))
    return f"hf:{path}"


def _bits(in_features: int, out_features: int, group: int, method: str) -> int:
    """Checkpoint bits of one linear: 4 per weight, a 16-bit scale and a 4-bit zero per
    group and output, and (GPTQ) a 32-bit group index per input."""
    groups = in_features // group
    bits = 4 * in_features * out_features + (16 + 4) * groups * out_features
    return bits + (32 * in_features if method == "gptq" else 0)


@pytest.mark.parametrize("method", ["gptq", "awq"])
@pytest.mark.parametrize(
    ("in_features", "out_features", "group"),
    [(4096, 11008, 128), (11008, 4096, 128), (4096, 1024, 32), (256, 512, -1)],
)
def test_checkpoint_bytes_are_four_bits_a_weight_plus_group_statistics(
    method, in_features, out_features, group
):
    fmt = Int4Format(method, group_size=group)
    linear = nn.Linear(in_features, out_features, bias=False, device="meta")
    layer = PackedInt4Linear(linear, fmt)
    size = in_features if group == -1 else group
    assert layer.checkpoint_bytes() * 8 == _bits(in_features, out_features, size, method)


def test_awq_layout_matches_autoawq_gemm_module():
    """AutoAWQ's own ``WQLinear_GEMM`` (where autoawq imports) registers the same tensors."""
    gemm = pytest.importorskip("awq.modules.linear.gemm")
    theirs = gemm.WQLinear_GEMM(4, 128, 256, 512, False, "cpu")
    ours = PackedInt4Linear(nn.Linear(256, 512, bias=False, device="meta"), Int4Format("awq"))
    for name in ("qweight", "qzeros", "scales"):
        assert getattr(ours, name).shape == getattr(theirs, name).shape, name
        assert getattr(ours, name).dtype == getattr(theirs, name).dtype, name


def _serve_weights(model: str, quantize: str) -> int:
    plan = vramplan.serve(
        model,
        gpu="h100",
        quantize=quantize,
        precision="fp16",
        max_model_len=256,
        max_num_batched_tokens=64,
        max_num_seqs=2,
    )
    return plan.weights_bytes


def test_marlin_serving_weights_drop_gptq_zeros_but_keep_awqs(llama):
    """Marlin (vLLM's and GPT-QModel's kernel for both on sm80+) repacks the weight and
    scales in place; symmetric GPTQ's zeros and its trivial ``g_idx`` are emptied, AWQ's
    zero points are kept. Embeddings, output head and norms stay fp16."""
    dense = 2 * (2 * VOCAB * HIDDEN + (2 * LAYERS + 1) * HIDDEN)
    packed = sum(i * o // 2 + (i // 128) * o * 2 for i, o in LINEARS) * LAYERS
    zeros = sum((i // 128) * o // 2 for i, o in LINEARS) * LAYERS
    assert _serve_weights(llama, "gptq") == dense + packed
    assert _serve_weights(llama, "awq") == dense + packed + zeros


def _transients(trace, iteration: int, nbytes: int) -> int:
    return sum(
        1
        for a in trace.allocations
        if a.iteration == iteration and a.nbytes == nbytes and a.category != Component.KV_CACHE
    )


def test_marlin_allocates_its_fp32_reduction_buffer_per_call(llama):
    """``gptq_marlin_gemm``: ``c_tmp`` of SMs × min(ceil16(M), 64) × 256 fp32 entries at
    every call — M the prompt's rows in the prefill, one row per sequence in a decode step."""
    recipe = Recipe(mode="generate", prompt_len=40, new_tokens=4, precision="fp16", quantize="gptq")
    _, trace = trace_and_estimate(resolve(llama, recipe), recipe)
    calls = len(LINEARS) * LAYERS
    assert _transients(trace, PREFILL, SMS * 48 * 256 * 4) == calls
    assert _transients(trace, DECODE, SMS * 16 * 256 * 4) == calls


@pytest.mark.parametrize(("seq_len", "dequantizes"), [(512, False), (513, True)])
def test_awq_gemm_dequantizes_whole_weights_above_1024_rows(llama, seq_len, dequantizes):
    """``AwqGemmFn``: ``x.shape[0] * x.shape[1] > 1024`` dequantizes the weight to an
    fp16 ``[in, out]`` copy; at or below it the fused GEMM writes the output alone."""
    recipe = Recipe(
        mode="infer", batch_size=2, seq_len=seq_len, precision="fp16", quantize="awq",
        quant_kernel="gemm",
    )  # fmt: skip
    _, trace = trace_and_estimate(resolve(llama, recipe), recipe)
    down = [a.nbytes for a in trace.allocations if a.module.endswith("mlp.down_proj")]
    assert (INTER * HIDDEN * 2 in down) is dequantizes


def test_exllamav2_scratch_is_the_largest_layers_temp_dq_and_temp_fwd(llama):
    recipe = Recipe(mode="infer", precision="fp16", quantize="gptq", quant_kernel="exllamav2")
    model = resolve(llama, recipe).model
    expected = max(i * o * 2 + 128 + o * 2048 * 8 * 4 + 128 for i, o in LINEARS)
    scratch = model.get_buffer("exllamav2_scratch")
    assert scratch.dtype == torch.float16
    assert scratch.numel() * 2 == expected


def test_act_order_keeps_g_idx_and_its_sort_indices_under_marlin(llama):
    plain = Recipe(mode="infer", precision="fp16", quantize="gptq")
    ordered = plain.with_changes(act_order=True)

    def gate(recipe: Recipe) -> dict[str, int]:
        layer = resolve(llama, recipe).model.model.layers[0].mlp.gate_proj
        return {n: t.numel() for n, t in [*layer.named_parameters(), *layer.named_buffers()]}

    assert gate(plain)["g_idx"] == 0
    assert gate(ordered)["g_idx"] == gate(ordered)["g_idx_sort_indices"] == HIDDEN


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--group-size", "64"], "need --quantize gptq|awq"),
        (["--quantize", "gptq", "--mode", "train"], "modelled for inference"),
        (["--quantize", "gptq", "--mode", "infer", "--quant-kernel", "gemm"], "marlin or"),
        (["--quantize", "awq", "--mode", "infer", "--act-order"], "AWQ has no act-order"),
        (["--quantize", "awq", "--mode", "infer", "--group-size", "48"], "Marlin takes"),
        (["--quantize", "gptq", "--mode", "infer", "--double-quant"], "bitsandbytes'"),
    ],
)
def test_bad_int4_flags_are_one_line(llama, run_cli, flags, message):
    code, _, err = run_cli("estimate", llama, *flags)
    assert code == 2
    assert message in err and "Traceback" not in err


def test_serve_takes_the_checkpoints_vllm_loads(llama, run_cli):
    code, _, err = run_cli("serve", llama, "--gpu", "h100", "--quantize", "nf4")
    assert code == 2
    assert "gptq, awq or fp8" in err and "Traceback" not in err
