"""A notebook user drives ``vramplan.Session`` through estimate → max batch → plan →
measure and gets exactly the numbers the command line prints for the same inputs."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import vramplan
from vramplan.cli import main

CARD = "1800MiB"  # the floor's high end alone is about 1.5 GiB


def _cli_json(capsys, *args: str) -> dict:
    try:
        code = main([*args, "--json"])
    except SystemExit as exc:  # pragma: no cover - a failure shows its message below
        code = exc.code
    out, err = capsys.readouterr()
    assert code in (0, 3), err
    return json.loads(out)


def test_session_answers_what_the_cli_prints(capsys, tiny_cnn):
    knobs = {"batch_size": 4, "input_shape": "3x32x32", "optimizer": "adam"}
    flags = ["--batch-size", "4", "--input-shape", "3x32x32", "--optimizer", "adam"]
    session = vramplan.Session(tiny_cnn, gpu_memory=CARD)

    est = session.estimate(**knobs)
    cli = _cli_json(capsys, "estimate", tiny_cnn, *flags, "--gpu-memory", CARD)
    assert est.peak.to_json() == cli["peak"]
    assert est.components == cli["components"]
    assert est.verdict.to_json() == cli["verdict"]

    best = session.max_batch(**knobs)
    cli = _cli_json(capsys, "max-batch", tiny_cnn, *flags, "--gpu-memory", CARD)
    assert best.value == cli["max_batch_size"] > 4
    assert best.beyond.verdict.status != "fits" and best.estimate.verdict.status == "fits"

    answer = session.plan(**{**knobs, "batch_size": best.value + 1})
    cli = _cli_json(
        capsys,
        "plan",
        tiny_cnn,
        "--batch-size",
        str(best.value + 1),
        "--input-shape",
        "3x32x32",
        "--optimizer",
        "adam",
        "--gpu-memory",
        CARD,
    )
    assert answer.to_json()["plan"] == cli["plan"]
    assert [lever["peak"] for lever in answer.to_json()["levers"]] == [
        lever["peak"] for lever in cli["levers"]
    ]
    assert answer.levers.plan is not None and answer.levers.plan.status == "fits"

    measured = session.measure(**knobs, device="cpu", steps=3)
    cli = _cli_json(capsys, "measure", tiny_cnn, *flags, "--device", "cpu")
    assert measured.measured.allocated_bytes == cli["measured"]["allocated_bytes"]
    assert measured.errors == cli["errors"]
    assert measured.estimate.peak.to_json() == cli["estimate"]["peak"]


def test_session_reuses_its_traces(tiny_cnn):
    session = vramplan.Session(tiny_cnn, gpu_memory=CARD)
    first = session.estimate(batch_size=2, input_shape=(3, 32, 32))
    again = session.estimate(vramplan.Recipe(batch_size=2, input_shape="3x32x32"))
    assert again is first


def test_module_conveniences_wrap_the_session(tiny_cnn):
    direct = vramplan.Session(tiny_cnn, gpu_memory=CARD).estimate(
        batch_size=2, input_shape="3x32x32"
    )
    wrapped = vramplan.estimate(tiny_cnn, gpu_memory=CARD, batch_size=2, input_shape="3x32x32")
    assert wrapped.peak == direct.peak


def test_session_refuses_bad_input_in_one_line():
    with pytest.raises(vramplan.UserError, match="unknown target"):
        vramplan.Session("hf:gpt2", target="tpu")
    session = vramplan.Session(nn.Linear(8, 2), example_batch=torch.zeros(2, 8))
    with pytest.raises(vramplan.UserError, match="unknown recipe knob 'batchsize'"):
        session.estimate(batchsize=2)
    with pytest.raises(vramplan.UserError, match="needs a card"):
        session.max_batch()
    with pytest.raises(vramplan.UserError, match="nn.Module's own weights"):
        session.measure(device="cpu")
