"""A paged 8-bit AdamW step read off the plain 8-bit Adam step's trace (``trace/paged.py``)
equals the paged step traced: the same trace event for event, the same estimate."""

from __future__ import annotations

import json

import pytest
from conftest import TINY_LLAMA

from vramplan.device.options import device_options
from vramplan.pipeline import flop_counting_policy, trace_and_estimate
from vramplan.planner.bench import Workbench
from vramplan.recipe import Recipe
from vramplan.sources import resolve
from vramplan.trace.paged import PAGED_TERM


@pytest.fixture(params=[2, 16], ids=["whole", "repeated"])
def llama(request, tmp_path):
    """TINY_LLAMA with a wider MLP: embedding, head and MLP weights of 131,072 elements
    (paged), attention weights of 4,096 (8-bit, not paged), norms fp32; 2 blocks (traced
    whole) or 16 (repeated)."""
    config = {**TINY_LLAMA, "intermediate_size": 2048, "num_hidden_layers": request.param}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return f"hf:{path}"


@pytest.mark.parametrize(
    "changes,counts_flops",
    [
        ({}, False),
        ({"precision": "amp-bf16", "activation_offload": True}, True),
        ({"checkpointing": "full"}, False),
        ({"optimizer_in_backward": True}, False),
    ],
    ids=["fp32", "amp-offload-flops", "checkpointed", "in-backward"],
)
def test_paged_step_read_off_equals_the_traced_one(llama, changes, counts_flops):
    device = device_options(gpu="t4")
    recipe = Recipe(batch_size=1, seq_len=16, optimizer="paged_adamw_8bit", **changes)
    bench = Workbench(llama, device, counts_flops=counts_flops)
    eight = bench.estimate(recipe.with_changes(optimizer="adam8bit"))
    read_off, trace = bench.run(recipe)
    assert bench.traces == 1  # the 8-bit step's only
    flop_policy = flop_counting_policy(device) if counts_flops else None
    traced, truth = trace_and_estimate(resolve(llama, recipe), recipe, "cuda", device, flop_policy)
    assert PAGED_TERM not in eight.details.get("host_bytes", {})
    assert trace.allocations == truth.allocations
    assert (trace.phases, trace.event_count) == (truth.phases, truth.event_count)
    assert trace.host_bytes == truth.host_bytes  # a rebuilt trace's keys come in set order
    assert trace.op_counts == truth.op_counts and trace.notes == truth.notes
    assert json.dumps(read_off.to_json(), sort_keys=True) == json.dumps(
        traced.to_json(), sort_keys=True
    )
    paged = trace.host_bytes[PAGED_TERM]
    assert read_off.peak.allocated_bytes <= eight.peak.allocated_bytes - paged // 2
