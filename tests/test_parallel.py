"""Traces side by side (``--jobs``, ``planner/parallel.py``): the answer is the one of
tracing one recipe at a time, whether the workers trace or find their autograd unusable."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from vramplan.planner.levers import _accumulation_trials, _between
from vramplan.planner.parallel import can_fork
from vramplan.planner.shared_traces import ShortTraceStore
from vramplan.recipe import Recipe
from vramplan.session import Session
from vramplan.trace.autograd_fork import forked_autograd_runs

needs_fork = pytest.mark.skipif(not can_fork(), reason="workers are forked on Linux only")


def _without_timing(data, drop=("trace_seconds", "traces_side_by_side")):
    """A plan's or search's JSON without what differs between runs: seconds, and how many
    traces ran where."""
    if isinstance(data, dict):
        return {k: _without_timing(v, drop) for k, v in data.items() if k not in drop}
    if isinstance(data, list):
        return [_without_timing(v, drop) for v in data]
    return data


def _max_batch(model: str, jobs: int) -> dict:
    """``vramplan max-batch`` in a fresh process: its autograd has run nothing before the
    workers are forked, so they trace."""
    args = ["max-batch", model, "--input-shape", "3x32x32", "--optimizer", "sgd"]
    args += ["--gpu-memory", "1800MiB", "--json", "--jobs", str(jobs)]
    done = subprocess.run(
        [sys.executable, "-m", "vramplan", *args], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@needs_fork
def test_max_batch_side_by_side_equals_one_at_a_time(tiny_cnn):
    alone, side_by_side = _max_batch(tiny_cnn, 1), _max_batch(tiny_cnn, 2)
    assert alone["traces_side_by_side"] == 0
    assert side_by_side["traces_side_by_side"] >= 2  # the first two sizes at least
    # side by side, a search may trace a candidate it turns out not to need
    traces = ("trace_seconds", "traces_side_by_side", "traces", "trace_labels")
    assert _without_timing(side_by_side, traces) == _without_timing(alone, traces)
    assert set(alone["trace_labels"]) <= set(side_by_side["trace_labels"])


@needs_fork
def test_a_session_that_traced_before_plans_one_trace_at_a_time(tiny_cnn):
    """After a traced training step in this process, forked workers could not run
    autograd: none is forked, and the bench traces every recipe itself, with the same
    answer."""
    answers = []
    for jobs in (1, 2):
        session = Session(tiny_cnn, gpu_memory="1750MiB", jobs=jobs)
        session.estimate(batch_size=2, input_shape=(3, 32, 32))  # autograd has run here
        assert not forked_autograd_runs()
        plan = session.plan(batch_size=64, input_shape=(3, 32, 32))
        assert plan.side_by_side == 0
        answers.append(_without_timing(plan.to_json()))
    assert answers[0] == answers[1]


_FAULTY_SCRIPT = """
import json, os, sys, time
from vramplan.planner import parallel
from vramplan.trace import autograd_fork
from vramplan.session import Session

model, jobs, fault, met = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
traced_in_worker = parallel._trace_in_worker

def faulty(recipe):  # in a worker: batch 2 meets the fault
    if recipe.batch_size == 2 and fault in ("dies", "hangs"):
        open(met, "a").close()
        if fault == "dies":
            os._exit(9)  # as the kernel's out-of-memory killer ends a process
        time.sleep(3600)
    return traced_in_worker(recipe)

parallel._trace_in_worker = faulty
parallel.patience = lambda: 3.0
shape = (3, 32, 32)
if fault == "traced before":  # a backward the tracer did not note: the workers' probe fails
    Session(model, gpu_memory="1800MiB").estimate(batch_size=2, input_shape=shape)
    autograd_fork._ran_backward = False
session = Session(model, gpu_memory="1800MiB", jobs=jobs)
search = session.max_batch(input_shape=shape, optimizer="sgd")
print(json.dumps({"search": search.to_json(), "side_by_side": search.side_by_side}))
"""


@needs_fork
@pytest.mark.parametrize("fault", ["dies", "hangs", "traced before"])
def test_a_lost_worker_leaves_the_answer_to_the_bench(tiny_cnn, fault, tmp_path):
    """A worker killed mid-trace, one that never answers (taken back after ``patience``),
    or workers whose autograd refuses to run: the search ends with the answer of tracing
    one recipe at a time."""
    met = tmp_path / "met"

    def search(jobs: int, fault: str) -> dict:
        done = subprocess.run(
            [sys.executable, "-c", _FAULTY_SCRIPT, tiny_cnn, str(jobs), fault, str(met)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    alone, faulty = search(1, "none"), search(2, fault)
    assert alone["side_by_side"] == 0
    assert faulty["side_by_side"] == 0 if fault == "traced before" else met.exists()
    traces = ("trace_seconds", "traces_side_by_side", "traces", "trace_labels")
    assert _without_timing(faulty["search"], traces) == _without_timing(alone["search"], traces)


def test_a_claim_of_a_process_that_ended_is_given_up(tmp_path):
    """A short trace claimed by a worker that died is traced by the next who needs it at
    once, not after ``WAIT``; one claimed by a live worker is waited for."""
    ended = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    store = ShortTraceStore(tmp_path, {})
    assert store.claim(("mine",)) and not store.claim(("mine",))
    assert not store.wait(("mine",), timeout=0.2)  # this process claimed it and lives on
    store._path(("theirs",), ".claim").write_text(ended.stdout.strip())
    start = time.monotonic()
    assert not store.wait(("theirs",), timeout=60)
    assert time.monotonic() - start < 30
    store[("mine",)] = "a trace"
    assert ShortTraceStore(tmp_path, {}).wait(("mine",), timeout=0.2)


def test_jobs_must_be_positive(tiny_cnn, run_cli):
    code, _, err = run_cli("max-batch", tiny_cnn, "--gpu-memory", "1800MiB", "--jobs", "0")
    assert code == 2 and "--jobs must be 1 or more" in err and "Traceback" not in err


def test_the_search_trials_of_several_jobs_cover_what_bisection_tries():
    """Selective checkpointing's counts: one job bisects; more split the bracket evenly,
    inside it, without repeats."""
    assert _between(0, 32, 1) == [16]
    for low, high in [(0, 32), (5, 9), (16, 18), (0, 2)]:
        for parts in (2, 3, 8):
            counts = _between(low, high, parts)
            assert counts == sorted(set(counts))
            assert all(low < n < high for n in counts)
            assert len(counts) == min(parts, high - low - 1)
    trials = _accumulation_trials(Recipe(batch_size=12, grad_accum=2), {})
    assert [(t["batch_size"], t["grad_accum"]) for t in trials] == [
        (6, 4), (4, 6), (3, 8), (2, 12), (1, 24)
    ]  # fmt: skip
    assert _accumulation_trials(Recipe(batch_size=8), {"optimizer_in_backward": True}) == []


_SHARED_SCRIPT = """
import json, os, sys
from vramplan.trace import repeat
from vramplan.device.options import device_options
from vramplan.planner.bench import Workbench
from vramplan.recipe import Recipe

model, jobs, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cut = repeat.truncated

def logged(model, run, blocks):  # one line per short trace, from whichever process
    with open(log, "a") as file:
        file.write(f"{os.getpid()} {blocks}\\n")
    return cut(model, run, blocks)

repeat.truncated = logged
bench = Workbench(model, device_options(gpu_memory="941MiB"), shares_short_traces=True, jobs=jobs)
recipes = [Recipe(batch_size=4, seq_len=256, checkpointing=n) for n in ("5", "11")]
with bench.side_by_side(recipes[0]):
    bench.prefetch(recipes)
    estimates = [bench.estimate(r) for r in recipes]
print(json.dumps({
    "side_by_side": bench.log.side_by_side,
    "estimates": [
        [e.peak.to_json(), e.components, e.verdict.status] for e in estimates
    ],
}))
"""


@needs_fork
def test_workers_share_the_short_traces_of_checkpointed_counts(tmp_path):
    """Two counts of checkpointed blocks of a 16-block Llama traced side by side: the two
    workers make the five short traces of their family between them, none twice (each
    claims what it traces, ``shared_traces.py``), and both estimates are those of tracing
    one recipe at a time."""
    from conftest import PLAN_LLAMA

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**PLAN_LLAMA, "num_hidden_layers": 16}))

    def run(jobs: int) -> tuple[dict, list[str]]:
        log = tmp_path / f"short-traces-{jobs}.log"
        done = subprocess.run(
            [sys.executable, "-c", _SHARED_SCRIPT, f"hf:{path}", str(jobs), str(log)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout), log.read_text().split("\n")[:-1]

    (alone, traced_alone), (side_by_side, traced_side_by_side) = run(1), run(2)
    assert len(traced_alone) == 5 and side_by_side["side_by_side"] == 2
    assert sorted(line.split()[1] for line in traced_side_by_side) == sorted(
        line.split()[1] for line in traced_alone
    )  # the same five short traces, none twice
    assert side_by_side["estimates"] == alone["estimates"]


def _on_plan_llama(script: str, tmp_path) -> dict:
    """What ``script`` prints (JSON), run in a fresh process (its autograd has run nothing
    before the workers are forked) on the plan tests' Llama."""
    from conftest import PLAN_LLAMA

    path = tmp_path / "config.json"
    path.write_text(json.dumps(PLAN_LLAMA))
    done = subprocess.run(
        [sys.executable, "-c", script, f"hf:{path}"], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


_BUSY_SCRIPT = """
import json, sys
from vramplan.device.options import device_options
from vramplan.planner.bench import Workbench
from vramplan.recipe import Recipe

bench = Workbench(sys.argv[1], device_options(gpu_memory="941MiB"), jobs=2)
recipes = [Recipe(batch_size=b, seq_len=256) for b in (8, 4, 2, 1)]
ahead, *asked = recipes
with bench.side_by_side(ahead):
    workers = bench._workers
    started = workers.trace([], [ahead])  # a worker takes what may be asked for next
    left = workers.trace(asked, [])  # one worker free for three: the last stays here
    sent = sorted(workers.running)  # three sent to two workers: one waits in the queue
    nothing = workers.trace([], [])
    bench.run(left)
    estimates = [bench.estimate(r) for r in recipes]
print(json.dumps({
    "started": started is None,
    "left": left == asked[-1],
    "sent": sent == sorted(bench.key(r) for r in recipes[:3]),
    "nothing": nothing is None,
    "in_workers": bench.log.side_by_side,
    "statuses": [e.verdict.status for e in estimates],
}))
"""


@needs_fork
def test_the_bench_traces_one_itself_where_a_worker_still_traces_what_was_ahead(tmp_path):
    """Three recipes asked for while one of two workers traces a recipe sent ahead: two
    go to the workers, the last is left to the bench (it would only wait otherwise); with
    more sent than workers, asking for nothing leaves nothing; every estimate comes
    back."""
    result = _on_plan_llama(_BUSY_SCRIPT, tmp_path)
    assert result["started"] and result["left"] and result["sent"] and result["nothing"]
    assert result["in_workers"] == 3 and len(result["statuses"]) == 4


_PACKED_SCRIPT = """
import json, sys
from vramplan.device.options import device_options
from vramplan.planner.bench import Workbench
from vramplan.recipe import Recipe
from vramplan.trace.packed import PackedTrace
from vramplan.trace.repeat import same_events

recipes = [Recipe(batch_size=b, seq_len=256) for b in (2, 1)]
bench = Workbench(sys.argv[1], device_options(gpu_memory="941MiB"), jobs=2)
with bench.side_by_side(recipes[0]):
    bench.prefetch(recipes)
    estimates = [bench.estimate(r) for r in recipes]
    packed = [isinstance(bench._done[bench.key(r)][1], PackedTrace) for r in recipes]
    read = bench.run(recipes[0])[1]
    unpacked = not isinstance(bench._done[bench.key(recipes[0])][1], PackedTrace)
    still = isinstance(bench._done[bench.key(recipes[1])][1], PackedTrace)
alone = Workbench(sys.argv[1], device_options(gpu_memory="941MiB"))
print(json.dumps({
    "in_workers": bench.log.side_by_side,
    "packed": packed,
    "unpacked": unpacked,
    "still": still,
    "same_events": same_events(read, alone.run(recipes[0])[1]),
    "same_estimates": [e.to_json() for e in estimates] == [
        alone.estimate(r).to_json() for r in recipes
    ],
}))
"""


@needs_fork
def test_a_workers_trace_stays_packed_until_the_bench_reads_it(tmp_path):
    """Traces sent back by workers are kept pickled (``trace/packed.py``): reading their
    estimates leaves them so; ``run`` unpacks one, event for event the trace of the same
    recipe traced in this process, and leaves the others packed."""
    result = _on_plan_llama(_PACKED_SCRIPT, tmp_path)
    assert result["in_workers"] == 2 and result["packed"] == [True, True]
    assert result["unpacked"] and result["still"]
    assert result["same_events"] and result["same_estimates"]
