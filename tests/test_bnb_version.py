"""``--bnb-version``: bitsandbytes before 0.50 dequantized a 4-bit weight in the dtype it
was quantized from and then cast it to the compute dtype (``MatMul4Bit``:
``F.dequantize_4bit(B, quant_state).to(A.dtype)``); 0.50 writes the compute dtype at once."""

from __future__ import annotations

import json

import pytest
import torch

from vramplan import Recipe, UserError
from vramplan.pipeline import trace_and_estimate
from vramplan.sources import resolve
from vramplan.trace.generate import PREFILL

HIDDEN, INTER = 64, 128


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("bnb") / "config.json"
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 256,
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
    }
    path.write_text(json.dumps(config))
    return f"hf:{path}"


def _gate_prefill(llama: str, **knobs) -> list[int]:
    recipe = Recipe(
        mode="generate", prompt_len=16, new_tokens=2, precision="fp16", quantize="fp4", **knobs
    )
    _, trace = trace_and_estimate(resolve(llama, recipe), recipe)
    return [
        a.nbytes
        for a in trace.allocations
        if a.module.endswith("mlp.gate_proj") and a.iteration == PREFILL
    ]


def test_before_050_a_float32_compute_adds_a_copy_beside_the_fp16_weight(llama):
    weight = HIDDEN * INTER
    legacy = _gate_prefill(llama, compute_dtype="fp32", bnb_version="0.41")
    current = _gate_prefill(llama, compute_dtype="fp32")
    assert weight * 2 in legacy and weight * 4 in legacy
    assert weight * 4 in current and weight * 2 not in current


def test_dequantize_4bit_returns_the_dtype_it_was_quantized_from():
    """bitsandbytes' own ``dequantize_4bit`` on the CPU (the rule for 0.43 to 0.49, whose
    ``MatMul4Bit`` then cast the result to the compute dtype)."""
    functional = pytest.importorskip("bitsandbytes.functional")
    weight = torch.randn(INTER, HIDDEN, dtype=torch.bfloat16)
    packed, state = functional.quantize_4bit(weight, blocksize=64, quant_type="fp4")
    assert functional.dequantize_4bit(packed, state).dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"bnb_version": "0.41"}, "add --quantize nf4|fp4"),
        ({"bnb_version": "latest", "quantize": "nf4"}, "a release such as"),
    ],
)
def test_bad_bnb_versions(knobs, message):
    with pytest.raises(UserError, match=message):
        Recipe(mode="infer", **knobs)
