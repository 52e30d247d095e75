"""A planner's estimates share block repetition's short traces, and plan's FLOP count (its
recompute cost) is the whole depth's: both equal what tracing every block gives."""

from __future__ import annotations

import json

import pytest
from conftest import gqa_llama, plan_bench

from vramplan.planner.levers import step_flops
from vramplan.recipe import Recipe
from vramplan.trace import step
from vramplan.trace.repeat import same_events


@pytest.fixture(autouse=True)
def _short_runs_repeat_too(monkeypatch):
    """The tiny models here have 6-10 blocks; repetition's threshold is a speed policy."""
    monkeypatch.setattr("vramplan.trace.repeat.MIN_BLOCKS", 5)


@pytest.fixture
def llama(tmp_path):
    def spec(layers: int) -> str:
        path = tmp_path / f"llama{layers}.json"
        path.write_text(json.dumps(gqa_llama(layers)))
        return f"hf:{path}"

    return spec


def test_checkpointed_counts_share_short_traces(llama, monkeypatch):
    """Checkpointing 5 and then 6 of 11 blocks (both stretches long enough to repeat): the
    second estimate runs no trace of its own, nor the check that the short traces rebuild
    the 4-unit one (its family's, made once), and equals the full trace."""
    calls, checks = [], []
    real = step.trace_training

    def counted(*args, **kwargs):
        calls.append(args[1].checkpointing)
        return real(*args, **kwargs)

    def checked(rebuilt, traced):
        checks.append(len(traced.allocations))
        return same_events(rebuilt, traced)

    monkeypatch.setattr("vramplan.pipeline.trace_training", counted)
    monkeypatch.setattr("vramplan.trace.repeat.same_events", checked)
    spec = llama(11)
    bench = plan_bench(spec, repeat=True)
    bench.estimate(Recipe(batch_size=2, seq_len=32, checkpointing="5"))
    first = len(calls)
    recipe = Recipe(batch_size=2, seq_len=32, checkpointing="6")
    shared, rebuilt = bench.run(recipe)
    assert first > 0 and len(calls) == first
    assert len(checks) == 1
    assert any(
        n.startswith("repeated blocks: the 11 model.layers blocks are stretches of 6")
        for n in shared.notes
    )
    full, traced = plan_bench(spec, repeat=False).run(recipe)
    assert same_events(rebuilt, traced) and rebuilt.op_counts == traced.op_counts
    assert shared.peak.allocated_bytes == full.peak.allocated_bytes
    assert shared.components == full.components
    assert shared.phase_peaks == full.phase_peaks
    assert abs(shared.peak.reserved_bytes - full.peak.reserved_bytes) <= (
        0.005 * full.peak.reserved_bytes
    )


@pytest.mark.parametrize("count", ["8", "9"])
def test_a_short_plain_stretch_is_rebuilt_from_the_shared_traces(llama, monkeypatch, count):
    """Checkpointing 8 or 9 of 11 blocks leaves a plain stretch of 3 or 2 blocks, too
    short to check on its own: after 5 of 11 (whose short traces and check hold 2 to 4
    units of each stretch) it is rebuilt from them, with no trace of its own, and equals
    the full trace."""
    calls = []
    real = step.trace_training
    monkeypatch.setattr(
        "vramplan.pipeline.trace_training", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    spec = llama(11)
    bench = plan_bench(spec, repeat=True)
    bench.estimate(Recipe(batch_size=2, seq_len=32, checkpointing="5"))
    first = len(calls)
    recipe = Recipe(batch_size=2, seq_len=32, checkpointing=count)
    shared, rebuilt = bench.run(recipe)
    assert first > 0 and len(calls) == first
    full, traced = plan_bench(spec, repeat=False).run(recipe)
    assert same_events(rebuilt, traced) and rebuilt.op_counts == traced.op_counts
    assert shared.peak.allocated_bytes == full.peak.allocated_bytes
    assert shared.components == full.components


def test_recompute_flops_are_the_whole_depths(llama):
    """FlopCounterMode over a trace of every block is the ground truth (checkpointed: the
    recomputed forward counted too)."""
    spec = llama(6)
    recipe = Recipe(batch_size=2, seq_len=32, checkpointing="full")
    repeated = step_flops(plan_bench(spec, repeat=True), recipe)
    assert repeated == step_flops(plan_bench(spec, repeat=False), recipe)
