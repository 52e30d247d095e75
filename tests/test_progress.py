"""The progress line and the planner's account of its traces: the callback sees every
trace the JSON counts, each timed; nothing reaches stderr under --json or --quiet, even on
a terminal."""

from __future__ import annotations

import io
import json
import sys

import vramplan
from vramplan.cli import main
from vramplan.report.progress import progress_wanted, trace_progress

CARD = "1800MiB"
KNOBS = {"batch_size": 4, "input_shape": "3x32x32", "optimizer": "adam"}


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def _check_events(events, traced: list[tuple[str, float]], count: int, first: int = 1) -> None:
    started = [e for e in events if not e.done]
    finished = [e for e in events if e.done]
    assert len(started) == len(finished) == len(traced) == count > 0
    assert [e.index for e in finished] == list(range(first, first + count))
    assert [e.label for e in started] == [e.label for e in finished]
    assert [(e.label, e.seconds) for e in finished] == traced
    assert all(e.seconds > 0 for e in finished)


def test_max_batch_progress_sees_each_trace_the_json_counts(tiny_cnn):
    events = []
    session = vramplan.Session(tiny_cnn, gpu_memory=CARD, progress=events.append)
    result = session.max_batch(**KNOBS)
    data = result.to_json()
    _check_events(events, list(result.traced), data["traces"])
    assert len(data["trace_seconds"]) == len(data["trace_labels"]) == data["traces"]
    assert data["trace_labels"][0].endswith("batch 1, fp32, adam")


def test_plan_progress_sees_each_trace_flop_counts_included(tiny_cnn):
    events = []
    session = vramplan.Session(tiny_cnn, gpu_memory=CARD, progress=events.append)
    session.estimate(**KNOBS)  # cached: the plan's count starts after it
    events.clear()
    answer = session.plan(**KNOBS)
    data = answer.to_json()
    _check_events(events, list(answer.traced), data["traces"], first=2)
    assert any("FLOPs" in label for label in data["trace_labels"])
    assert data["trace_labels"].count(data["trace_labels"][0]) == 1
    assert len(session.log) == data["traces"] + 1


def _cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setenv("COLUMNS", "400")  # the long path of the model stays on the line
    try:
        code = main(list(args))
    except SystemExit as exc:  # pragma: no cover - shows the message below
        code = exc.code
    return code, capsys.readouterr().out, terminal.getvalue()


def test_nothing_on_stderr_under_json_or_quiet_even_on_a_terminal(monkeypatch, capsys, tiny_cnn):
    flags = ["--batch-size", "4", "--input-shape", "3x32x32", "--gpu-memory", CARD]
    code, out, err = _cli(monkeypatch, capsys, "max-batch", tiny_cnn, *flags, "--json")
    assert code == 0 and err == ""
    data = json.loads(out)
    assert len(data["trace_seconds"]) == data["traces"]

    code, out, err = _cli(monkeypatch, capsys, "estimate", tiny_cnn, *flags, "--quiet")
    assert code == 0 and err == "" and "Peak allocated" in out

    code, out, err = _cli(monkeypatch, capsys, "estimate", tiny_cnn, *flags)
    assert code == 0 and "Peak allocated" in out
    assert "trace 1 of 1: " in err and "cnn.py:make: batch 4, fp32, adamw" in err


def test_progress_only_for_a_person_at_a_terminal():
    assert progress_wanted(False, False, Terminal())
    assert not progress_wanted(True, False, Terminal())
    assert not progress_wanted(False, True, Terminal())
    assert not progress_wanted(False, False, io.StringIO())
    with trace_progress(False) as progress:
        assert progress is None
