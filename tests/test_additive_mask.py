"""transformers 4.x encoders always added an extended attention mask, in the weights'
dtype, to the scores (``--additive-mask``); under fp16 autocast that makes the scores fp32
before softmax, which a stack before PyTorch 1.11 keeps for backward."""

from __future__ import annotations

import json

import pytest

from vramplan.device.options import device_options
from vramplan.errors import UserError
from vramplan.pipeline import trace_and_estimate
from vramplan.recipe import Recipe
from vramplan.sources import resolve

BATCH, SEQ, HEADS = 2, 64, 4
BERT = {
    "model_type": "bert",
    "architectures": ["BertForSequenceClassification"],
    "vocab_size": 128,
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": HEADS,
    "intermediate_size": 64,
    "max_position_embeddings": SEQ,
    "num_labels": 2,
    "attn_implementation": "eager",
}


def _kept(tmp_path, additive_mask: bool) -> list[tuple[str, int]]:
    """(op, bytes) of the attention's second-iteration tensors of (batch, heads, seq, seq)
    elements that live from forward into backward, other than softmax's output and
    dropout's mask."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(BERT))
    recipe = Recipe(
        batch_size=BATCH,
        seq_len=SEQ,
        optimizer="sgd",
        precision="amp-fp16",
        additive_mask=additive_mask,
    )
    options = device_options(gpu="v100-16gb", stack="torch1.10-cu11.2")
    trace = trace_and_estimate(resolve(f"hf:{path}", recipe), recipe, "cuda", options)[1]
    backward = min(m.index for m in trace.phases if m.iteration == 2 and m.phase == "backward")
    scores = BATCH * HEADS * SEQ * SEQ
    return sorted(
        (a.op, a.nbytes)
        for a in trace.allocations
        if a.iteration == 2
        and a.phase == "forward"
        and a.module.endswith("attention.self")
        and a.op not in ("_softmax", "native_dropout")
        and a.nbytes in (2 * scores, 4 * scores)
        and (a.free_index is None or a.free_index > backward)
    )


def test_the_mask_makes_the_kept_softmax_input_fp32(tmp_path):
    """Without the mask softmax keeps the scaled fp16 scores; with it, the fp32 sum. Both
    keep the fp16 copy of the dropped probabilities the second matmul reads."""
    scores = BATCH * HEADS * SEQ * SEQ
    probabilities = ("_to_copy", 2 * scores)
    assert _kept(tmp_path, additive_mask=False) == [probabilities, ("mul", 2 * scores)]
    assert _kept(tmp_path, additive_mask=True) == [probabilities, ("add", 4 * scores)]


def test_the_mask_is_refused_for_a_causal_model(gpt2_config):
    recipe = Recipe(batch_size=1, seq_len=16, additive_mask=True)
    with pytest.raises(UserError, match="additive-mask"):
        resolve(f"hf:{gpt2_config()}", recipe)
