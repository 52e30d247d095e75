"""What ``plan`` reuses or skips gives what the work would: its own card judged by the
estimates it traced (equal to replaying them again), and the fewest recomputed blocks found
by a line and bisection (equal to trying every count)."""

from __future__ import annotations

import json

import pytest
from conftest import PLAN_LLAMA

from vramplan.device.options import device_options
from vramplan.device.replay import apply_device
from vramplan.pipeline import estimate_from_trace
from vramplan.planner.bench import Workbench
from vramplan.planner.levers import _first_round, _selective
from vramplan.recipe import Recipe


@pytest.fixture
def tiny_llama(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(PLAN_LLAMA))
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


@pytest.fixture
def llama8(tmp_path):
    """A tiny Llama of 8 blocks: at batch 4, seq 256, recomputing the first block saves
    about 40 MiB of the high end the verdict reads, each further one about 6 MiB."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**PLAN_LLAMA, "num_hidden_layers": 8}))
    return f"hf:{path}"


def test_fewest_recomputed_blocks_equal_the_exhaustive_answer(llama8):
    recipe = Recipe(batch_size=4, seq_len=256)
    bench = Workbench(llama8, device_options(gpu_memory="941MiB"), shares_short_traces=True)
    assert bench.estimate(recipe).verdict.status != "fits"
    chosen = _selective(bench, recipe, {"checkpointing": "full"})
    searched = bench.traces
    counts = [*map(str, range(1, 8)), "full"]
    fewest = next(n for n in counts if bench.fits(recipe.with_changes(checkpointing=n)))
    assert chosen == {"checkpointing": fewest} == {"checkpointing": "6"}
    assert searched <= 1 + 1 + 2  # no checkpointing, all, the line's guess and one more


def test_what_is_traced_ahead_is_what_the_search_asks_first(llama8):
    """``_first_round`` (traced ahead while other traces run) names the step with no block
    recomputed until it is known, then the count the line through both ends predicts:
    the traces ``_selective`` asks for first, in that order."""
    recipe = Recipe(batch_size=4, seq_len=256)
    bench = Workbench(llama8, device_options(gpu_memory="941MiB"), shares_short_traces=True)
    changes = {"checkpointing": "full"}
    assert bench.fits(recipe.with_changes(**changes))
    assert _first_round(bench, recipe, changes) == [recipe]
    bench.estimate(recipe)
    ahead = _first_round(bench, recipe, changes)
    before = bench.traces
    _selective(bench, recipe, changes)
    asked = [label for label, _ in bench.log.since(before)]
    assert len(ahead) == 1 and asked[0] == bench.label(ahead[0])


def test_another_card_is_judged_with_its_own_measured_table(tiny_llama):
    """The H200 has a bundled table for torch 2.11 + CUDA 13.0; a bench traced for an A100
    on that stack judges the H200 with it, and a bench on the H200 judges the A100 without."""
    from vramplan.device.catalog import lookup_gpu

    recipe = Recipe(batch_size=2, seq_len=64)
    stack = "torch2.11-cu13.0"

    def measured_note(bench: Workbench, card: str) -> bool:
        notes = bench.on(recipe, lookup_gpu(card)).notes
        return any(n.startswith("measured figures for") for n in notes)

    assert measured_note(
        Workbench(tiny_llama, device_options(gpu="a100-80gb", stack=stack)), "h200"
    )
    assert not measured_note(
        Workbench(tiny_llama, device_options(gpu="h200", stack=stack)), "a100-80gb"
    )


def test_no_accumulation_trial_is_traced_where_the_weights_alone_do_not_fit(tmp_path):
    """A Llama whose fp32 weights (131M parameters of embeddings and head, 525 MB) fill
    more than a 600 MiB card's usable share: the table's accumulation row is two
    micro-batches, what tracing every trial finds (none fits), without tracing them."""
    from vramplan.planner.levers import _accumulation_row, _accumulation_trials

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**PLAN_LLAMA, "vocab_size": 32000, "hidden_size": 2048}))
    bench = Workbench(f"hf:{path}", device_options(gpu_memory="600MiB"))
    recipe = Recipe(batch_size=4, seq_len=64)
    baseline = bench.estimate(recipe)
    assert baseline.model.parameter_bytes >= baseline.verdict.usable_bytes
    assert _accumulation_row(bench, recipe, baseline) == {"batch_size": 2, "grad_accum": 2}
    assert bench.traces == 1
    trials = [recipe.with_changes(**t) for t in _accumulation_trials(recipe, {})]
    assert len(trials) == 2 and not any(bench.fits(trial) for trial in trials)


def test_no_lora_floor_is_traced_where_the_half_precision_weights_do_not_fit(tmp_path):
    """A Llama of two wide blocks (128M parameters, 256 MB in bf16) on a 256 MiB card: the
    bf16 weights alone do not fit, so the LoRA base is left out of the plan's adapter tier
    (QLoRA's quantized base stays), and its floor, traced, indeed does not fit."""
    from vramplan.planner.levers import LORA, QLORA, LeverResult, _adapter_bases, _floors

    path = tmp_path / "config.json"
    wide = {**PLAN_LLAMA, "hidden_size": 2048, "intermediate_size": 8192}
    path.write_text(json.dumps(wide))
    bench = Workbench(f"hf:{path}", device_options(gpu_memory="256MiB"))
    recipe = Recipe(batch_size=2, seq_len=64)

    def lever(name: str, changes: dict) -> LeverResult:
        return LeverResult(name, changes, bench.estimate(recipe.with_changes(**changes)), 0, {})

    bf16 = lever("bf16 weights", {"precision": "bf16"})
    assert bf16.estimate.model.parameter_bytes >= bf16.estimate.verdict.usable_bytes
    adapters = [LeverResult("LoRA", LORA, None, 0, {}), LeverResult("QLoRA", QLORA, None, 0, {})]
    bases = _adapter_bases(adapters, bf16)
    assert [names for names, _ in bases] == [("bf16 weights", "QLoRA")]
    lora_floor = _floors(recipe, {"precision": "bf16", **LORA, "loss_chunks": 8}, True)[-1]
    assert not bench.fits(lora_floor)


def test_no_accumulation_trial_is_traced_where_weights_gradients_and_state_do_not_fit(tmp_path):
    """The same wide Llama on a 1500 MiB card: its fp32 weights (631 MB) leave room, but
    with their gradients and AdamW's two moments they hold four times that at every
    micro-batch, past the usable line. The accumulation row is two micro-batches without a
    trial traced, and tracing every trial finds none that fits."""
    from vramplan.planner.levers import _accumulation_row, _accumulation_trials

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**PLAN_LLAMA, "vocab_size": 32000, "hidden_size": 2048}))
    bench = Workbench(f"hf:{path}", device_options(gpu_memory="1500MiB"))
    recipe = Recipe(batch_size=4, seq_len=64)
    baseline = bench.estimate(recipe)
    weights = baseline.model.parameter_bytes
    assert weights < baseline.verdict.usable_bytes
    resident = bench.resident_bytes(recipe)
    assert resident == 4 * weights + baseline.model.buffer_bytes > baseline.verdict.usable_bytes
    assert _accumulation_row(bench, recipe, baseline) == {"batch_size": 2, "grad_accum": 2}
    assert bench.traces == 1
    for trial in _accumulation_trials(recipe, {}):
        traced = bench.estimate(recipe.with_changes(**trial))
        assert traced.verdict.status != "fits" and traced.peak.allocated_bytes > resident


@pytest.mark.parametrize("card,traced", [("1611MiB", 1), ("2000MiB", 2)])
def test_a_free_lever_is_kept_without_tracing_the_partly_checkpointed_trial(tmp_path, card, traced):
    """A plan that recomputes 6 of 8 blocks and chunks its loss: without the chunks, every
    block recomputed holds 1752 MiB at the high end. On a card whose line is under that
    (1611 MiB: 1450), the chunks stay after one trace, the partly checkpointed trial is
    not traced, and tracing it shows it would not fit either; where every block
    recomputed fits (2000 MiB), the plan's own trial is traced and decides."""
    from vramplan.planner.levers import LeverResult, _Tier, _without_unneeded

    path = tmp_path / "config.json"
    wide = {"vocab_size": 32000, "hidden_size": 256, "intermediate_size": 512}
    path.write_text(json.dumps({**PLAN_LLAMA, "num_hidden_layers": 8, **wide}))
    bench = Workbench(f"hf:{path}", device_options(gpu_memory=card))
    recipe = Recipe(batch_size=4, seq_len=512)
    chunked = LeverResult("chunked loss", {"loss_chunks": 8}, None, 0, {})
    base = (("bf16 weights",), {"precision": "bf16"})
    tier = _Tier((base,), ((chunked,),), ((chunked,),), True)
    plan = {"precision": "bf16", "loss_chunks": 8, "checkpointing": "6"}
    assert bench.fits(recipe.with_changes(**plan))
    traces = bench.traces
    names, changes, kept = _without_unneeded(bench, recipe, base[0], plan, (chunked,), tier)
    assert kept == (chunked,) and changes == plan
    assert bench.traces == traces + traced
    unchunked = recipe.with_changes(precision="bf16", checkpointing="6")
    assert bench.has(bench.key(unchunked)) == (traced == 2)
    assert not bench.fits(unchunked)
