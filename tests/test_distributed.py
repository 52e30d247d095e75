"""Past one GPU: DeepSpeed's ZeRO formulas exactly, FSDP per-rank figures against the
sharding arithmetic, TP/PP division, GPUs needed, and bad layouts."""

from __future__ import annotations

import json

import pytest

from vramplan.cli import main
from vramplan.device.options import device_options
from vramplan.distributed.facts import facts_of
from vramplan.distributed.layout import ParallelLayout, per_rank
from vramplan.distributed.needed import STRATEGIES, gpus_needed
from vramplan.distributed.zero import zero2_model_states, zero3_model_states
from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe
from vramplan.sources import resolve

PSI, LARGEST = 7_000_000_000, 250_000_000


def test_zero2_matches_deepspeed_estimator():
    # estimate_zero2_model_states_mem_needs: 4Ψ + 16Ψ/N on GPU; CPU 4Ψ·gpus_per_node·1.5
    states = zero2_model_states(PSI, gpus_per_node=8)
    assert states.gpu_bytes == 4 * PSI + 16 * PSI // 8
    assert states.cpu_bytes == int(PSI * 4 * 8 * 1.5)
    offload = zero2_model_states(PSI, gpus_per_node=8, cpu_offload=True)
    assert offload.gpu_bytes == 2 * PSI and offload.cpu_bytes == int(PSI * max(32, 16) * 1.5)


def test_zero3_matches_deepspeed_estimator():
    # estimate_zero3_model_states_mem_needs: 4·largest + 18Ψ/N; offload variants
    assert zero3_model_states(PSI, LARGEST, gpus_per_node=8).gpu_bytes == (
        4 * LARGEST + 18 * PSI // 8
    )
    assert zero3_model_states(PSI, LARGEST, gpus_per_node=8, nodes=2).gpu_bytes == (
        4 * LARGEST + 18 * PSI // 16
    )
    partial = zero3_model_states(PSI, LARGEST, gpus_per_node=8, cpu_offload=True)
    assert partial.gpu_bytes == 4 * LARGEST + 2 * PSI // 8
    assert partial.cpu_bytes == int(PSI * 16 * 1.5)
    full = zero3_model_states(
        PSI, LARGEST, gpus_per_node=8, cpu_offload=True, cpu_offload_params=True
    )
    assert full.gpu_bytes == 4 * LARGEST and full.cpu_bytes == int(PSI * 18 * 1.5)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama") / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 1024,
                "hidden_size": 128,
                "intermediate_size": 344,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 256,
            }
        )
    )
    spec = f"hf:{path}"
    recipe = Recipe(batch_size=2, seq_len=64, precision="amp-bf16")
    estimate = estimate_built(resolve(spec, recipe), recipe, "cuda", device_options(gpu="h100"))
    return spec, estimate, facts_of(resolve(spec, recipe))


def test_fsdp_per_rank_follows_the_sharding_arithmetic(llama):
    _, single, facts = llama
    rank = per_rank(single, ParallelLayout(shard="fsdp", data_parallel=8), facts)
    states = sum(single.components[k] for k in ("parameters", "gradients", "optimizer_state"))
    per_param = single.components["parameters"] / facts.parameters
    # formula: state/N + the unsharded working set: the root group (embeddings, head) and
    # the current and prefetched block gathered in bf16, one block of gradients before
    # reduce-scatter
    gathered = (facts.root_parameters + 2 * facts.largest_block_parameters) * 2
    expected_states = states / 8 + gathered + facts.largest_block_parameters * per_param
    rank_states = sum(rank.components[k] for k in ("parameters", "gradients", "optimizer_state"))
    assert rank_states == pytest.approx(expected_states, rel=0.01)
    # a sharded engine makes no autocast copy of the weights (2 bytes each); the copies
    # are saved for backward, so they leave the activations
    phase = single.details["phase_components"][rank.peak.phase]
    cast_cache = 2 * facts.parameters
    assert rank.components["activations"] == phase["activations"] - min(
        cast_cache, phase["activations"]
    )
    phase_states = sum(phase[k] for k in ("parameters", "gradients", "optimizer_state"))
    assert rank.peak.allocated_bytes == pytest.approx(
        sum(phase.values()) - phase_states + rank_states - cast_cache, abs=16
    )
    assert rank.peak.allocated_bytes < single.peak.allocated_bytes
    assert rank.peak.allocated_bytes <= rank.peak.reserved_bytes <= rank.peak.device_total_bytes


def test_tensor_and_pipeline_parallel_divide(llama):
    _, single, facts = llama
    phases = single.details["phase_components"]

    def activations(layout):
        rank = per_rank(single, layout, facts)
        return rank.components["activations"], phases[rank.peak.phase]["activations"]

    ours, theirs = activations(ParallelLayout(tensor_parallel=2, sequence_parallel=True))
    assert ours == theirs // 2
    ours, theirs = activations(ParallelLayout(pipeline_parallel=2, microbatches=4))
    assert ours == theirs  # two micro-batches in flight x half the layers
    ours, theirs = activations(ParallelLayout(pipeline_parallel=2, microbatches=1))
    assert ours == theirs // 2


def test_gpus_needed_is_the_smallest_that_fits(llama):
    spec, _, facts = llama
    recipe = Recipe(batch_size=2, seq_len=64, precision="amp-bf16")
    tight = estimate_built(
        resolve(spec, recipe), recipe, "cuda", device_options(gpu_memory="1540MiB", headroom=0.0)
    )
    answer = gpus_needed(tight, facts)
    assert answer.estimate.verdict.status == "fits"
    if answer.gpus > 1:
        smaller = answer.gpus // 2
        for strategy in STRATEGIES:
            layout = ParallelLayout(
                shard=strategy.shard if smaller > 1 else "none",
                data_parallel=smaller,
                offload_optimizer=strategy.offload_optimizer and smaller > 1,
            )
            assert per_rank(tight, layout, facts).verdict.status != "fits"


@pytest.mark.parametrize(
    "args,message",
    [
        (["--tp", "3"], "does not divide the 4 attention heads"),
        (["--pp", "5"], "larger than the 4 layers"),
        (["--zero", "4"], "ZeRO stage must be 1, 2 or 3"),
        (["--fsdp", "8", "--zero", "2"], "choose one of"),
        (["--offload-optimizer"], "go with --zero"),
    ],
)
def test_bad_layouts(capsys, llama, args, message):
    spec = llama[0]
    try:
        code = main(["estimate", spec, "--seq-len", "32", *args])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_cli_per_rank_json(capsys, llama):
    spec = llama[0]
    main(
        [
            "estimate",
            spec,
            "--seq-len",
            "64",
            "--batch-size",
            "2",
            "--precision",
            "amp-bf16",
            "--zero",
            "3",
            "--dp",
            "8",
            "--gpu",
            "h100",
            "--json",
        ]
    )
    data = json.loads(capsys.readouterr().out)
    assert data["details"]["parallel"]["layout"] == "zero3 dp=8"
    assert data["runtime"]["nccl"] > 0


def test_offloaded_optimizer_step_leaves_no_gpu_temporaries(llama):
    _, single, facts = llama
    layout = ParallelLayout(shard="zero3", data_parallel=8, offload_optimizer=True)
    rank = per_rank(single, layout, facts)
    optimizer_peak = rank.details["parallel"]["phase_peaks"]["optimizer"]
    on_device = ParallelLayout(shard="zero3", data_parallel=8)
    kept = per_rank(single, on_device, facts).details["parallel"]["phase_peaks"]["optimizer"]
    temporaries = single.details["phase_components"]["optimizer"]["temporaries"]
    # the host runs the step: the rank keeps its states and DeepSpeed's buckets only
    assert optimizer_peak < kept
    assert kept - optimizer_peak >= temporaries // 8 - rank.details["parallel"]["bucket_bytes"]


def test_gpus_needed_skips_offload_the_host_cannot_hold():
    from dataclasses import replace

    from vramplan.device.verdict import judge

    recipe = Recipe(batch_size=1, seq_len=128, precision="fp32")
    single = estimate_built(
        resolve("hf:qwen2.5-0.5b", recipe), recipe, "cuda", device_options(gpu="h100")
    )
    facts = facts_of(resolve("hf:qwen2.5-0.5b", recipe))
    # judged against a 4 GiB card: ZeRO-3 with the optimizer on the host fits two
    small = replace(single, verdict=judge("4GiB", 4 * 2**30, 0.0, single.peak.device_total_bytes))
    free = gpus_needed(small, facts)
    assert free.layout.offload_optimizer and free.gpus == 2
    host = free.estimate.details["parallel"]["host_state_bytes"]
    # a host that cannot hold that state: more GPUs, nothing offloaded
    bounded = gpus_needed(small, facts, host_limit=host - 1)
    assert not bounded.layout.offload_optimizer and bounded.gpus > free.gpus
    assert bounded.estimate.verdict.status == "fits"
