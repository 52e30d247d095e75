"""Property-based fuzz of the command line (bounded for CI; ``benchmarks/fuzz_cli.py``
runs 10,000 calls): whatever the flags and config fields, a call answers with figures that
agree with each other (exit 0, or 3 for OOM) or refuses in one line (exit 2) — never a
traceback, and never an answer to an input the bad-input matrix calls invalid."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.fuzz_cli import TINY_GPT2, fuzz_call, problems, run_cli_captured


def fuzz(examples: int) -> settings:
    """Bounded and reproducible: CI runs the same examples every time."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@fuzz(15)
@given(seed=st.integers(0, 2**32 - 1))
def test_fuzzed_calls_answer_or_refuse_in_one_line(folder, seed):
    args, invalid = fuzz_call(random.Random(seed), folder, ("estimate", "calc", "llm"))
    outcome = run_cli_captured(args)
    outcome.invalid = invalid
    assert problems(outcome) == [], (args, outcome.code, outcome.err[-1000:])


SIZE_FIELDS = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner")
ODD_VALUES = st.one_of(
    st.integers(-3, 2**41),
    st.text(max_size=4),
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.lists(st.integers(), max_size=2),
)


@fuzz(40)
@given(field=st.sampled_from(SIZE_FIELDS), value=ODD_VALUES)
def test_config_fields_are_validated_before_anything_is_built(folder, field, value):
    path = folder / "config.json"
    path.write_text(json.dumps({**TINY_GPT2, field: value}))
    outcome = run_cli_captured(["llm", f"hf:{path}", "--seq-len", "16", "--json"])
    sensible = isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**31
    if field == "n_inner" and value is None:
        sensible = True  # null means 4 x n_embd
    if field == "n_layer" and sensible:
        sensible = value <= 1000  # more layers than any model: refused
    if field == "n_head" and sensible:
        sensible = 32 % value == 0
    if field == "n_embd" and sensible:
        sensible = value % 2 == 0
    outcome.invalid = not sensible
    assert problems(outcome) == [], (field, value, outcome.err)
    assert outcome.code == (0 if sensible else 2), (field, value, outcome.err)
    if not sensible and field != "n_head" and field != "n_embd":
        assert field in outcome.err  # the message names the field


@fuzz(8)
@given(
    batch=st.integers(1, 64),
    precision=st.sampled_from(["fp32", "amp-bf16", "bf16", "amp-fp16"]),
    optimizer=st.sampled_from(["sgd", "adamw", "adam8bit", "adafactor"]),
    card=st.sampled_from(["--gpu t4", "--gpu h100", "--gpu-memory 600MiB", "--gpu-memory 1GiB"]),
    headroom=st.floats(0.0, 0.9),
    mode=st.sampled_from(["train", "infer"]),
)
def test_answers_keep_their_figures_in_order(
    tiny_gpt2_path, batch, precision, optimizer, card, headroom, mode
):
    args = ["estimate", f"hf:{tiny_gpt2_path}", "--batch-size", str(batch), "--seq-len", "32"]
    args += ["--precision", precision, "--optimizer", optimizer, "--mode", mode]
    args += [*card.split(), "--headroom", repr(headroom), "--json"]
    outcome = run_cli_captured(args)
    assert outcome.code in (0, 3), outcome.err
    assert problems(outcome) == []
    data = json.loads(outcome.out)
    assert (data["verdict"]["status"] == "oom") == (outcome.code == 3)


@pytest.fixture(scope="module")
def tiny_gpt2_path(folder):
    path = folder / "tiny.json"
    path.write_text(json.dumps(TINY_GPT2))
    return path
