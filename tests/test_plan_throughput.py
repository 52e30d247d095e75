"""The modelled step time that ranks plans, and the first plan it picks. Ground truth: FLOPs
counted by PyTorch's FlopCounterMode on the fake step, exact arithmetic over the layers'
shapes, and the estimates of the plans the search weighed."""

from __future__ import annotations

import json

import pytest
from conftest import MID_LLAMA, TINY_LLAMA, gqa_llama

from vramplan.device.options import device_options
from vramplan.planner.bench import Workbench
from vramplan.planner.levers import _accumulate, plan_levers, step_flops
from vramplan.planner.throughput import Throughput, rates_for
from vramplan.recipe import Recipe

pytest.importorskip("transformers")


def _bench(tmp_path, config: dict, card: str = "rtx4090") -> Workbench:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    options = device_options(gpu=card) if card[0].isalpha() else device_options(gpu_memory=card)
    return Workbench(f"hf:{path}", options)


def test_recomputing_n_blocks_adds_n_over_l_of_recomputing_all(tmp_path):
    """Blocks are identical, so the FLOPs counted with the first 2 of 4 blocks
    checkpointed are those without, plus half of what checkpointing all 4 adds."""
    bench = _bench(tmp_path, gqa_llama(4))
    recipe = Recipe(batch_size=2, seq_len=32, precision="amp-bf16", checkpointing="2")
    counted = step_flops(bench, recipe) / (2 * recipe.batch_size)  # two iterations
    modelled = Throughput(bench)._flops_per_sample(recipe)
    assert modelled == pytest.approx(counted, rel=1e-9)
    assert Throughput(bench).recompute_fraction(recipe) > 0


def test_dequantized_bytes_are_every_quantized_weight_written_and_read_in_bf16(tmp_path):
    """QLoRA's linears (all but the output head) each write their bf16 weight and the matmul
    reads it back: 2 x 2 bytes per element, per pass."""
    bench = _bench(tmp_path, TINY_LLAMA)
    recipe = Recipe(batch_size=1, seq_len=16, precision="bf16", quantize="nf4", lora_rank=4)
    hidden, inter = TINY_LLAMA["hidden_size"], TINY_LLAMA["intermediate_size"]
    per_layer = 4 * hidden * hidden + 3 * hidden * inter  # q, k, v, o; gate, up, down
    elements = TINY_LLAMA["num_hidden_layers"] * per_layer
    assert Throughput(bench).dequantized_bytes(recipe) == 2 * 2 * elements
    assert Throughput(bench).dequantized_bytes(recipe.with_changes(quantize="none")) == 0


def test_weight_reads_repeat_per_micro_step_and_per_recomputed_pass(tmp_path):
    """Halving the micro-batch doubles the weight traffic and keeps the compute; recomputing
    every block reads the weights a third time."""
    bench = _bench(tmp_path, TINY_LLAMA)
    model = Throughput(bench)
    whole = model.step_time(Recipe(batch_size=2, seq_len=16, precision="bf16"))
    halves = model.step_time(Recipe(batch_size=1, grad_accum=2, seq_len=16, precision="bf16"))
    assert halves.compute == pytest.approx(whole.compute, rel=1e-9)
    assert halves.weights == pytest.approx(2 * whole.weights, rel=1e-12)
    parameter_bytes = bench.estimate(Recipe(batch_size=2, seq_len=16, precision="bf16"))
    rate = rates_for("RTX-4090").memory_bytes
    assert whole.weights == pytest.approx(2 * parameter_bytes.model.parameter_bytes / rate)
    recomputed = model.step_time(
        Recipe(batch_size=2, seq_len=16, precision="bf16", checkpointing="full")
    )
    assert recomputed.weights == pytest.approx(1.5 * whole.weights, rel=1e-12)


# Between QLoRA's high end at batch 4 (about 1436 MiB with the runtime) and LoRA's with
# every block recomputed (about 1522 MiB): the preconditions below check it.
TIGHT_CARD = "1676MiB"


@pytest.mark.slow
def test_first_plan_keeps_the_batch_with_qlora_where_lora_must_accumulate(tmp_path):
    """Full fine-tuning fits no combination; LoRA fits only in smaller micro-batches; QLoRA
    fits the user's batch of 4. The plan is QLoRA at batch 4, and its modelled step time is
    below LoRA's accumulating plan (the dequantization costs less than re-reading the
    weights per micro-step and recomputing)."""
    bench = _bench(tmp_path, MID_LLAMA, TIGHT_CARD)
    recipe = Recipe(batch_size=4, seq_len=128)
    result = plan_levers(bench, recipe)
    plan = result.plan
    assert plan is not None and plan.status == "fits"
    assert "QLoRA" in plan.name and plan.changes["quantize"] == "nf4"
    assert "grad_accum" not in plan.changes and "batch_size" not in plan.changes
    lora = {"precision": "bf16", "lora_rank": 16, "lora_targets": "all-linear"}
    assert not bench.fits(recipe.with_changes(**lora, checkpointing="full"))  # precondition
    accumulating = _accumulate(bench, recipe, {**lora, "checkpointing": "full"})
    assert accumulating is not None  # precondition: LoRA fits by accumulating
    model = Throughput(bench)
    qlora_time = model.step_time(recipe.with_changes(**plan.changes)).seconds
    lora_time = model.step_time(recipe.with_changes(**accumulating)).seconds
    assert qlora_time < lora_time
    assert plan.cost["dequantized_per_pass_bytes"] > 0
    assert plan.cost["modelled_overhead"] > 0
