"""A planner traces recipes that differ only in fields no model source reads on one build:
its estimates equal those of a build per recipe, and a build a trace ran on itself is not
used again."""

from __future__ import annotations

import json

import pytest
from conftest import gqa_llama, plan_bench

from vramplan.recipe import Recipe

BASE = Recipe(batch_size=2, seq_len=64, precision="bf16")
VARIANTS = [
    BASE,
    BASE.with_changes(grad_accum=2),
    BASE.with_changes(checkpointing="full"),
    BASE.with_changes(checkpointing="6"),
    BASE.with_changes(optimizer_in_backward=True),
]


@pytest.fixture(autouse=True)
def _short_runs_repeat_too(monkeypatch):
    """The tiny model here has 10 blocks; repetition's threshold is a speed policy."""
    monkeypatch.setattr("vramplan.trace.repeat.MIN_BLOCKS", 5)


@pytest.fixture
def llama(tmp_path) -> str:
    path = tmp_path / "llama10.json"
    path.write_text(json.dumps(gqa_llama(10)))
    return f"hf:{path}"


def test_one_build_serves_the_recipes_and_estimates_as_a_build_each(llama):
    shared_builds: list = []
    shared = plan_bench(llama, builds=shared_builds)
    together = [shared.estimate(recipe).to_json() for recipe in VARIANTS]
    assert len(shared_builds) == 1  # bf16 casts it after the first: the others trace it so
    for recipe, estimate in zip(VARIANTS, together, strict=True):
        alone = plan_bench(llama).estimate(recipe).to_json()
        assert json.dumps(estimate, sort_keys=True) == json.dumps(alone, sort_keys=True)


def test_a_build_traced_whole_is_built_again(llama):
    builds: list = []
    bench = plan_bench(llama, repeat=False, builds=builds)
    bench.estimate(BASE)
    bench.estimate(BASE.with_changes(grad_accum=2))
    assert len(builds) == 2


def test_fields_a_source_reads_get_their_own_build(llama):
    builds: list = []
    bench = plan_bench(llama, builds=builds)
    bench.estimate(BASE)
    bench.estimate(BASE.with_changes(optimizer="sgd"))  # Keras builds read the optimizer
    bench.estimate(BASE.with_changes(loss_chunks=4))  # the fine-tuning loss is built
    assert len(builds) == 3
