"""Planning: the largest batch that fits, levers that never add memory, plans that
reproduce through the ordinary flags, and honest answers when nothing fits."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
from conftest import PLAN_LLAMA, TINY_GEMMA3

from vramplan import estimate
from vramplan.cli import main
from vramplan.device.options import device_options
from vramplan.device.verdict import judge
from vramplan.errors import UserError
from vramplan.planner.bench import Workbench
from vramplan.planner.host import HostOptions, host_memory
from vramplan.planner.levers import (
    _candidates,
    _finetune_candidates,
    _nothing_fits_note,
    plan_levers,
)
from vramplan.planner.search import bisection_cost, largest_fitting
from vramplan.recipe import Recipe
from vramplan.units import format_bytes

# The runtime floor (CUDA context, cuBLAS and cuDNN kernels) is about 746 MiB, and the high
# end of its range, which the verdict reads, about 1530 MiB: these cards leave a tiny model
# room for a batch limit in the tens to hundreds.
CARD = "1800MiB"


@pytest.fixture
def tiny_llama(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(PLAN_LLAMA))
    return f"hf:{path}"


def _bench(model: str, card: str = CARD) -> Workbench:
    return Workbench(model, device_options(gpu_memory=card))


@pytest.mark.parametrize(
    "model,recipe",
    [
        ("tiny_cnn", Recipe(batch_size=1, input_shape=(3, 32, 32), optimizer="sgd")),
        ("tiny_llama", Recipe(batch_size=1, seq_len=64)),
    ],
)
def test_max_batch_fits_and_one_more_does_not(request, model, recipe):
    spec = request.getfixturevalue(model)
    bench = _bench(spec)
    result = largest_fitting(bench, recipe)
    assert result.value >= 1
    fresh = estimate(
        spec,
        batch_size=result.value,
        gpu_memory=CARD,
        input_shape=recipe.input_shape,
        seq_len=recipe.seq_len,
        optimizer=recipe.optimizer,
    )
    assert fresh.verdict.status == "fits"
    over = estimate(
        spec,
        batch_size=result.value + 1,
        gpu_memory=CARD,
        input_shape=recipe.input_shape,
        seq_len=recipe.seq_len,
        optimizer=recipe.optimizer,
    )
    assert over.verdict.status != "fits"
    assert result.traces <= result.bisection_traces


def test_longest_context_for_inference(tiny_llama):
    bench = _bench(tiny_llama)
    result = largest_fitting(
        bench, Recipe(batch_size=4, seq_len=16, mode="infer"), "seq_len", start=16
    )
    assert result.estimate.verdict.status == "fits"
    assert result.beyond is None or result.beyond.verdict.status != "fits"


def test_bisection_cost_counts_doubling_then_halving():
    assert bisection_cost(1, 1) == 3  # 1, 2 fail -> bracket [1, 2]: one more
    assert bisection_cost(1, 86) == 14


def test_levers_never_add_memory_and_accumulation_keeps_the_batch(tiny_cnn):
    recipe = Recipe(batch_size=64, input_shape=(3, 32, 32), optimizer="adamw")
    bench = _bench(tiny_cnn, "1800MiB")
    result = plan_levers(bench, recipe)
    names = [lever.name for lever in result.levers]
    assert names[:3] == ["mixed precision", "bf16 weights", "activation checkpointing"]
    for lever in result.levers:
        assert lever.estimate.peak.allocated_bytes <= result.baseline.peak.allocated_bytes, lever
    accumulation = next(lever for lever in result.levers if lever.name == "gradient accumulation")
    changes = accumulation.changes
    assert changes["batch_size"] * changes["grad_accum"] == 64
    checkpoint = next(lever for lever in result.levers if "checkpointing" in lever.name)
    assert checkpoint.cost["recompute_fraction"] > 0


def test_plan_reproduces_through_ordinary_flags(capsys, tiny_cnn):
    code = main(
        [
            "plan",
            tiny_cnn,
            "--batch-size",
            "64",
            "--input-shape",
            "3x32x32",
            "--gpu-memory",
            "1800MiB",
            "--json",
        ]
    )
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["plan"] is not None
    plan = data["plan"]
    assert plan["status"] == "fits"
    args = [
        "estimate",
        tiny_cnn,
        "--batch-size",
        "64",
        "--input-shape",
        "3x32x32",
        "--gpu-memory",
        "1800MiB",
        "--json",
        *plan["flags"].split(),
    ]
    main(args)
    again = json.loads(capsys.readouterr().out)
    assert again["peak"]["device_total_bytes"] == plan["peak"]["device_total_bytes"]
    assert again["verdict"]["status"] == "fits"


@pytest.mark.parametrize(
    "gpu,amp",
    [
        ("B200", "amp-bf16"),
        ("RTX-5090", "amp-bf16"),
        ("A100-80GB", "amp-bf16"),
        ("MI300X", "amp-bf16"),
        ("T4", "amp-fp16"),
        ("V100-16GB", "amp-fp16"),
    ],
)
def test_mixed_precision_lever_follows_compute_capability(gpu, amp):
    # "sm100" < "sm80" as strings: Blackwell must still be offered bf16, pre-Ampere fp16.
    bench = Workbench("unused:model", device_options(gpu=gpu))
    levers = {name: changes for name, changes, _ in _candidates(bench, Recipe(batch_size=4))}
    assert levers["mixed precision"] == {"precision": amp}
    assert ("bf16 weights" in levers) == (amp == "amp-bf16")


def test_nothing_fits_says_so(tiny_cnn):
    bench = _bench(tiny_cnn, "512MiB")
    message = "does not fit .* even at batch size 1: the high end of its range needs"
    with pytest.raises(UserError, match=message) as refused:
        largest_fitting(bench, Recipe(batch_size=1, input_shape=(3, 32, 32)))
    # both figures are the job's own bytes (no driver reserve), the high end above the central
    found = re.search(r"needs ([\d,]+) bytes \(central ([\d,]+)\)", str(refused.value))
    high, central = (int(found.group(i).replace(",", "")) for i in (1, 2))
    assert high >= central


def test_plan_without_gpu_lists_every_card(capsys, tiny_cnn):
    code = main(["plan", tiny_cnn, "--batch-size", "4", "--input-shape", "3x16x16", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and len(data["gpus"]) >= 18
    assert all(row["status"] == "fits" for row in data["gpus"])


def test_host_memory_terms():
    est = estimate("torchvision:resnet18", batch_size=8, input_shape=(3, 64, 64), target="cpu")
    batch = 8 * 3 * 64 * 64 * 4 + 8 * 8  # images + int64 labels
    host = host_memory(
        est,
        HostOptions(workers=2, prefetch_factor=2, offload_optimizer=True, limit_bytes=1),
        est.details["optimizer_state_bytes"],
    )
    assert host.terms["dataloader_batches"] == 4 * batch
    assert host.terms["pinned_buffers"] == 4 * batch
    assert host.terms["offloaded_optimizer_state"] == 2 * est.model.parameter_bytes
    assert host.exceeds_limit


def test_plan_prints_whole_flags_on_a_narrow_terminal(capsys, monkeypatch, tiny_cnn):
    """At 80 columns the table wraps its cells; the flags to copy must stay whole."""
    monkeypatch.setenv("COLUMNS", "80")
    args = ["plan", tiny_cnn, "--batch-size", "64", "--input-shape", "3x32x32"]
    main([*args, "--gpu-memory", "1800MiB", "--json"])
    data = json.loads(capsys.readouterr().out)
    main([*args, "--gpu-memory", "1800MiB"])
    lines = capsys.readouterr().out.splitlines()
    for lever in data["levers"]:
        assert any(line.strip() == f"{lever['name']}: {lever['flags']}" for line in lines)
    assert any(data["plan"]["flags"] in line for line in lines)


def test_a_plan_refused_only_by_the_high_ends_says_what_fits_at_the_central_figure(tiny_cnn):
    """On a 1 GiB card a tiny CNN's central figure is under the usable line but the high
    end of its range (the runtime floor's unknowns) is past it, with every lever: no plan,
    and the note names the least central figure and the unknown, not a larger card."""
    result = plan_levers(_bench(tiny_cnn, "1GiB"), Recipe(batch_size=1, input_shape=(3, 32, 32)))
    verdict = result.baseline.verdict
    assert result.plan is None and verdict.status == "tight"
    assert verdict.central_bytes <= verdict.usable_bytes < verdict.compared_bytes
    rows = [result.baseline, *(lever.estimate for lever in result.levers)]
    least = min(row.verdict.central_bytes for row in rows)
    note = result.notes[-1]
    assert f"needs {format_bytes(least)} at the central figure" in note
    assert "CUDA context" in note and "larger card" not in note
    # the same rows on a card under every central figure: a larger card is needed
    small = judge("small", least, 0.0, least + 1)
    past = [
        replace(lever, estimate=replace(lever.estimate, verdict=small)) for lever in result.levers
    ]
    refusal = _nothing_fits_note(replace(result.baseline, verdict=small), past)
    assert "a larger card, or sharding across GPUs, is needed" in refusal


def test_a_vision_language_model_is_offered_lora_and_qlora(tmp_path):
    """Full fine-tuning of a vision-language model that does not fit: LoRA and QLoRA are
    levers, as for a decoder (all linear layers adapted, the vision tower's too)."""
    path = tmp_path / "gemma3.json"
    path.write_text(json.dumps(TINY_GEMMA3))
    bench = _bench(f"hf:{path}", "700MiB")
    recipe = Recipe(batch_size=1, seq_len=8)
    assert bench.estimate(recipe).verdict.status != "fits"
    offered = {name: changes for name, changes, _ in _finetune_candidates(bench, recipe)}
    assert offered["LoRA"]["lora_targets"] == "all-linear"
    assert offered["QLoRA"]["quantize"] == "nf4"
