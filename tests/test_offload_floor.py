"""The floor ``plan`` reads under a step with activation offloading before tracing it
(``Workbench.offloaded_floor_bytes``): what the step holds besides its activations, with
what the card holds outside the allocator. Offloading moves only saved tensors, so the
floor is under the offloaded step's device total, as its own trace shows; where the floor
passes the usable line, the plan skips that trace and answers the same."""

from __future__ import annotations

import json

import pytest
from conftest import PLAN_LLAMA

from vramplan.device.options import device_options
from vramplan.planner.bench import Workbench
from vramplan.planner.levers import _floors, _viable
from vramplan.recipe import Recipe


@pytest.fixture(scope="module")
def four_blocks(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama") / "config.json"
    wider = {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512}
    path.write_text(json.dumps({**PLAN_LLAMA, "num_hidden_layers": 4, **wider}))
    return Workbench(f"hf:{path}", device_options(gpu_memory="2000MiB"))


@pytest.mark.parametrize(
    "recipe",
    [
        Recipe(batch_size=4, seq_len=128),
        Recipe(batch_size=4, seq_len=128, checkpointing="full"),
        Recipe(batch_size=1, grad_accum=4, seq_len=128, checkpointing="full", precision="amp-bf16"),
        Recipe(
            batch_size=4, seq_len=128, checkpointing="2", precision="amp-bf16", optimizer="adam8bit"
        ),
        Recipe(batch_size=4, seq_len=128, precision="bf16", optimizer_in_backward=True),
        Recipe(batch_size=2, grad_accum=2, seq_len=128, precision="amp-bf16"),
        Recipe(batch_size=4, seq_len=128, checkpointing="full", loss_chunks=4),
    ],
    ids=["fp32", "full", "amp-accum", "amp-2-of-4-8bit", "bf16-in-backward", "amp-2x2", "chunks"],
)
def test_the_floor_is_under_the_offloaded_step_and_over_what_stays(four_blocks, recipe):
    bench = four_blocks
    plain = bench.estimate(recipe)
    offloaded = bench.estimate(recipe.with_changes(activation_offload=True))
    floor = bench.offloaded_floor_bytes(recipe)
    outside = plain.peak.device_total_bytes - plain.peak.reserved_bytes
    assert outside == offloaded.peak.device_total_bytes - offloaded.peak.reserved_bytes
    assert floor <= offloaded.peak.device_total_bytes
    # more than the weights, gradients and state alone (``resident_bytes``) tell
    assert floor > bench.resident_bytes(recipe) + outside


@pytest.mark.parametrize("card,traces", [("2200MiB", 2), ("2500MiB", 3)])
def test_an_offloaded_floor_past_the_line_is_not_traced(tmp_path, card, traces):
    """A wide Llama in mixed precision with plain SGD, every block recomputed: one sample
    per micro-batch holds its fp32 weights and accumulated gradients and the bf16 copies
    autocast makes, 1.6 GiB, whatever offloading moves. On a 2200 MiB card its floor is
    past the line and ``_viable`` stops after two traces; on 2500 MiB it is not, and the
    offloaded step is traced. Either way no rung fits, as tracing each shows."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**PLAN_LLAMA, "vocab_size": 32000, "hidden_size": 2048}))
    bench = Workbench(f"hf:{path}", device_options(gpu_memory=card))
    recipe = Recipe(batch_size=4, seq_len=64, precision="amp-bf16", optimizer="sgd")
    assert not _viable(bench, recipe, [{}], True)
    assert bench.traces == traces
    *lighter, floor = _floors(recipe, {}, True)
    usable = bench.estimate(floor).verdict.usable_bytes
    skipped = bench.offloaded_floor_bytes(lighter[-1]) > usable
    assert skipped == (traces == 2)
    assert [bench.fits(rung) for rung in (*lighter, floor)] == [False, False, False]


def test_what_offloading_leaves_on_the_card_is_in_the_floor(tmp_path):
    """A 32000-token vocabulary in mixed precision, one sample per micro-batch, every block
    recomputed: what the head and the loss save (the offloader pauses at the head) and the
    block recomputed in backward stay on the card with offloading, and the floor counts
    them. On a 960 MiB card (864 MiB usable) that puts it past the line: ``_viable`` stops
    after two traces, and tracing the offloaded step shows that it does not fit."""
    path = tmp_path / "config.json"
    wide = {"vocab_size": 32000, "hidden_size": 256, "intermediate_size": 512}
    path.write_text(json.dumps({**PLAN_LLAMA, "num_hidden_layers": 4, **wide}))
    bench = Workbench(f"hf:{path}", device_options(gpu_memory="960MiB"))
    recipe = Recipe(batch_size=4, seq_len=256, precision="amp-bf16")
    assert not _viable(bench, recipe, [{}], True)
    assert bench.traces == 2
    *lighter, offloaded = _floors(recipe, {}, True)
    floor = bench.offloaded_floor_bytes(lighter[-1])
    assert bench.estimate(offloaded).verdict.usable_bytes < floor
    assert floor <= bench.estimate(offloaded).peak.device_total_bytes
    assert not bench.fits(offloaded)
