"""``--quantize fp8``: every linear but the output head as transformers' fine-grained FP8
layer stores it — checked against transformers' own ``FP8Linear`` built on the meta
device — and kept in fp8 when the model is cast to bf16 for serving."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import vramplan
from vramplan.sources.fp8_weights import Fp8Linear

HIDDEN, INTER, VOCAB, LAYERS = 128, 320, 512, 2


@pytest.mark.parametrize(("in_features", "out_features"), [(300, 520), (4096, 14336)])
def test_layout_matches_transformers_fp8_linear(in_features, out_features):
    from transformers.integrations.finegrained_fp8 import FP8Linear

    with torch.device("meta"):
        theirs = FP8Linear(in_features, out_features, block_size=(128, 128))
    ours = Fp8Linear(nn.Linear(in_features, out_features, bias=False, device="meta"))
    for name in ("weight", "weight_scale_inv"):
        assert getattr(ours, name).shape == getattr(theirs, name).shape, name
        assert getattr(ours, name).dtype == getattr(theirs, name).dtype, name


def test_serving_weights_are_a_byte_a_weight_plus_block_scales(tmp_path):
    path = tmp_path / "config.json"
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
    }
    path.write_text(json.dumps(config))
    plan = vramplan.serve(
        f"hf:{path}", gpu="h100", quantize="fp8", max_model_len=256,
        max_num_batched_tokens=64, max_num_seqs=2,
    )  # fmt: skip
    linears = [(HIDDEN, HIDDEN), (HIDDEN, 64), (HIDDEN, 64), (HIDDEN, HIDDEN)]
    linears += [(HIDDEN, INTER), (HIDDEN, INTER), (INTER, HIDDEN)]
    blocks = sum(-(-i // 128) * -(-o // 128) for i, o in linears)
    fp8 = sum(i * o for i, o in linears)
    dense = 2 * (2 * VOCAB * HIDDEN + (2 * LAYERS + 1) * HIDDEN)  # bf16 embeddings, head, norms
    assert plan.weights_bytes == dense + LAYERS * (fp8 + 4 * blocks)
