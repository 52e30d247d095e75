"""What ``plan`` and ``max-batch`` reuse instead of working again gives what the work
would: each derived estimate equals the one computed directly."""

from __future__ import annotations

import json

import pytest

from vramplan.device.options import device_options
from vramplan.device.replay import apply_device
from vramplan.pipeline import estimate_from_trace
from vramplan.planner.bench import Workbench
from vramplan.recipe import Recipe


@pytest.fixture
def tiny_llama(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 512,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 512,
            }
        )
    )
    return f"hf:{path}"


def _replayed(bench: Workbench, recipe: Recipe):
    """The traced step judged on the bench's card again: the tensor-level summary of its
    trace replayed through the device model (what ``Workbench.on`` did for every card)."""
    estimate, trace = bench.run(recipe)
    tensors = estimate_from_trace(trace, estimate.model, recipe, "cuda", list(trace.notes))
    return apply_device(tensors, trace, bench.device)


@pytest.mark.parametrize(
    "card,status", [("2000MiB", "fits"), ("520MiB", "tight"), ("300MiB", "oom")]
)
def test_the_bench_card_is_judged_by_the_traced_estimate(tiny_llama, card, status):
    bench = Workbench(tiny_llama, device_options(gpu_memory=card))
    recipe = Recipe(batch_size=2, seq_len=64)
    traced = bench.traces
    judged = bench.on(recipe, bench.device.card)
    again = _replayed(bench, recipe)
    assert bench.traces == traced + 1
    assert judged is bench.estimate(recipe)  # no second replay on the same card
    assert judged.verdict == again.verdict and judged.verdict.status == status
    assert judged.peak == again.peak
    assert judged.components == again.components
