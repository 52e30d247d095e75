"""``vramplan measure`` takes the fine-tuning flags ``estimate`` takes, and the estimate
matches a real CPU run of the same step. Ground truth: PyTorch's profiler over the real
run (``measurement/run.py``) and exact arithmetic on peft's adapter count."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

HIDDEN, INTER, LAYERS, RANK = 64, 128, 2, 4
TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
              "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
              "max_position_embeddings": 128, "tie_word_embeddings": False}  # fmt: skip


@pytest.mark.parametrize(
    "flags",
    [
        ["--lora", str(RANK), "--lora-targets", "q_proj,v_proj"],
        ["--lora", str(RANK), "--lora-targets", "q_proj,v_proj", "--loss-chunks", "4"],
        ["--train-only", "*.layers.1.*", "--optimizer-in-backward"],
        ["--lora", str(RANK), "--lora-targets", "q_proj,v_proj", "--checkpointing", "full"],
    ],
    ids=["lora", "lora-chunked-loss", "train-only-in-backward", "lora-checkpointed"],
)
def test_measure_runs_the_finetuning_step_it_estimates(flags, tmp_path, run_cli):
    """With checkpointing there is no cache, so transformers 5 looks for packed sequences
    in the position ids; fake tensors cannot answer, and the trace built a causal mask and
    expanded the grouped key-value heads that the real run never made (+3%)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    args = ["measure", f"hf:{path}", "-s", "64", "-b", "2", "--device", "cpu", "--json"]
    code, out, err = run_cli(*args, *flags)
    assert code == 0, err
    result = json.loads(out)
    assert abs(result["errors"]["allocated"]) <= 0.01
    model = result["estimate"]["model"]
    if "--lora" in flags:  # r * (in + out) on q (HIDDEN -> HIDDEN), v (HIDDEN -> HIDDEN / 2)
        assert model["trainable_parameters"] == LAYERS * RANK * (2 * HIDDEN + HIDDEN * 3 // 2)
    else:
        assert model["trainable_parameters"] < model["parameters"]
