"""FSDP2 traced as one rank of a fake process group: its sharded states against exact
division, the saving against the sharded model-state share, the layout formula against the
trace within a stated bound, the side streams, and the CLI."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist
from conftest import fsdp_peaks

from vramplan.cli import main
from vramplan.device.options import device_options
from vramplan.distributed.facts import facts_of
from vramplan.distributed.fsdp import Fsdp2
from vramplan.distributed.layout import ParallelLayout, per_rank
from vramplan.distributed.needed import GpusNeeded
from vramplan.pipeline import estimate_built
from vramplan.planner.bench import Workbench
from vramplan.planner.sharded import traced_answer
from vramplan.recipe import Recipe
from vramplan.sources import resolve

STATES = ("parameters", "gradients", "optimizer_state")
WORLD = 8


@pytest.fixture(scope="module")
def llama_spec(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_fsdp") / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 4096,
                "hidden_size": 256,
                "intermediate_size": 688,
                "num_hidden_layers": 4,
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "max_position_embeddings": 256,
            }
        )
    )
    return f"hf:{path}"


def _estimate(spec, recipe, engine=None):
    device = device_options(gpu="h100", data_parallel=engine.world_size if engine else 1)
    return estimate_built(resolve(spec, recipe), recipe, "cuda", device, engine=engine)


@pytest.fixture(scope="module")
def runs(llama_spec):
    recipe = Recipe(batch_size=2, seq_len=128, precision="fp32", optimizer="adamw")
    return {
        "single": _estimate(llama_spec, recipe),
        "fsdp": _estimate(llama_spec, recipe, Fsdp2(WORLD)),
        "grad_op": _estimate(llama_spec, recipe, Fsdp2(WORLD, reshard_after_forward=False)),
        "facts": facts_of(resolve(llama_spec, recipe)),
    }


def test_optimizer_state_is_sharded_exactly(runs):
    single = runs["single"].details["optimizer_state_bytes"]
    rank = runs["fsdp"].details["optimizer_state_bytes"]
    # each shard is padded to a whole row count: at most one row per parameter more
    assert single / WORLD <= rank <= single / WORLD * 1.02


def test_rank_saves_the_sharded_state_share(runs):
    single, rank = runs["single"], runs["fsdp"]
    assert rank.peak.allocated_bytes < single.peak.allocated_bytes
    for phase in ("forward", "backward"):
        ours = rank.details["phase_components"][phase]
        theirs = single.details["phase_components"][phase]
        states = sum(theirs[k] for k in STATES)
        gathered = ours["parameters"] - theirs["parameters"] / WORLD
        saved = sum(theirs.values()) - sum(ours.values())
        # phase by phase, a rank saves the sharded share of the model states less what
        # FSDP2 holds gathered; activations and temporaries are the same step's
        assert saved == pytest.approx(states * (1 - 1 / WORLD) - gathered, rel=0.03)
    assert not dist.is_initialized()  # the fake process group is gone again


def test_layout_formula_is_within_its_bound_of_the_trace(runs):
    formula = per_rank(
        runs["single"], ParallelLayout(shard="fsdp", data_parallel=WORLD), runs["facts"]
    )
    traced = runs["fsdp"].peak.allocated_bytes
    # the formula is the conservative fallback (used with TP/PP and in the GPU-count
    # search): never below the trace, at most 30% above it
    assert traced <= formula.peak.allocated_bytes <= 1.3 * traced


def test_gathered_root_and_blocks_are_parameters(runs):
    rank, facts = runs["fsdp"], runs["facts"]
    sharded = runs["single"].components["parameters"] / WORLD
    per_param = runs["single"].components["parameters"] / facts.parameters
    gathered = rank.components["parameters"] - sharded
    # at the peak the root group is gathered (again, in backward: it reshards after forward
    # under the explicit reshard_after_forward=True), with the blocks in flight
    assert gathered >= facts.root_parameters * per_param
    in_flight = facts.root_parameters + 2 * facts.largest_block_parameters
    assert gathered <= in_flight * per_param * 1.02


def test_keeping_blocks_gathered_costs_more(runs):
    kept, resharded = runs["grad_op"], runs["fsdp"]
    assert kept.peak.allocated_bytes > resharded.peak.allocated_bytes
    assert kept.components["parameters"] > resharded.components["parameters"]


def test_device_figures_and_nccl(runs):
    rank = runs["fsdp"]
    assert rank.peak.allocated_bytes <= rank.peak.reserved_bytes <= rank.peak.device_total_bytes
    assert rank.runtime["nccl"] > 0
    assert any("FSDP2 traced as rank 0 of 8" in note for note in rank.notes)


def test_cli_fsdp_is_traced(capsys, llama_spec):
    code = main(
        [
            "estimate",
            llama_spec,
            "--seq-len",
            "64",
            "--batch-size",
            "2",
            "--fsdp",
            "4",
            "--gpu",
            "h100",
            "--json",
        ]
    )
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["details"]["parallel"] == data["details"]["parallel"] | {
        "layout": "fsdp dp=4",
        "world_size": 4,
        "traced": True,
    }
    assert data["runtime"]["nccl"] > 0


def test_a_gpu_count_answer_is_confirmed_by_tracing(llama_spec, runs):
    recipe = Recipe(batch_size=2, seq_len=128, precision="fp32", optimizer="adamw")
    bench = Workbench(llama_spec, device_options(gpu="h100"))
    layout = ParallelLayout(shard="fsdp", data_parallel=WORLD)
    formula = per_rank(bench.estimate(recipe), layout, runs["facts"])
    answer = traced_answer(bench, GpusNeeded(WORLD, layout, formula), recipe)
    assert answer.estimate.details["parallel"]["traced"] is True
    assert answer.estimate.peak.allocated_bytes == runs["fsdp"].peak.allocated_bytes
    assert answer.estimate.verdict.status == "fits"
    zero = ParallelLayout(shard="zero3", data_parallel=WORLD)  # not traceable: unchanged
    kept = GpusNeeded(WORLD, zero, per_rank(bench.estimate(recipe), zero, runs["facts"]))
    assert traced_answer(bench, kept, recipe) is kept


def test_traced_rank_equals_pytorchs_fsdp_mem_tracker(llama_spec):
    """PyTorch's own FSDPMemTracker, run on the same sharded model, fake tensors and fake
    process group, measures the same tensor-level peak as our trace of that rank."""
    recipe = Recipe(batch_size=2, seq_len=128, precision="fp32", optimizer="adamw")
    ours, theirs = fsdp_peaks(llama_spec, recipe, world=4)
    assert ours == pytest.approx(theirs, rel=0.005)
