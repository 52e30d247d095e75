"""Traces of one workbench run side by side, in worker processes forked from it.

``plan`` and ``max-batch`` know several recipes they will need before they need them (the
levers of the table, the floors of each base, a search's next candidates). Each trace is
single-threaded Python, so on a machine with cores to spare those recipes are traced at
once: workers forked from the bench trace a share of them each and send back each
estimate with its trace (and the short traces of repeated blocks they made,
``trace/repeat.py``). The answer is the same as tracing them one after another; only the
wall-clock changes::

    with bench.side_by_side(Recipe(batch_size=8)):   # workers forked here, before any trace
        bench.prefetch([Recipe(batch_size=8), Recipe(batch_size=16)])
        bench.estimate(Recipe(batch_size=16))   # already traced: no trace here

The workers are forked before the bench traces anything: PyTorch's autograd engine
refuses to run backward in a process forked after its parent ran one (its device threads
do not survive a fork: https://github.com/pytorch/pytorch/wiki/Autograd-and-Fork). A
worker that finds its autograd unusable (a session that traced before) says so, and the
bench goes on one trace at a time. Forking is used only on Linux; elsewhere, with one
job, or for a single recipe, nothing runs here and the bench traces each recipe when it
is asked for. A recipe whose trace fails in a worker is left to the bench, which traces it
again and raises its error in the caller.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from vramplan.trace.repeat_plan import family

if TYPE_CHECKING:
    from multiprocessing.pool import Pool

    from vramplan.recipe import Recipe


class Workbench(Protocol):
    """What the workers need of ``bench.Workbench`` (which imports this module)."""

    log: Any

    def run(self, recipe: Recipe) -> tuple[Any, Any]: ...

    def keep(self, *outcome: Any) -> None: ...

    def label(self, recipe: Recipe) -> str: ...

    def short_traces_made(self) -> dict: ...


MAX_JOBS = 8
"""Workers at most by default: each builds and traces its own copy of the model (a worker
of a 405B-parameter model's plan grows by a few hundred MiB)."""
UNUSABLE = "autograd unusable after fork"
"""A worker's answer when its autograd engine refuses to run (see the module docstring)."""

_BENCH: Workbench | None = None
"""The bench a forked worker traces with (set in the parent just before the fork)."""


def default_jobs() -> int:
    """The processes ``plan`` and ``max-batch`` trace with when ``--jobs`` is not given: the
    cores this process may run on that are not busy now (``busy_cores``), at least 1 and
    at most ``MAX_JOBS``. A worker on a busy core only slows the others down.

    >>> 1 <= default_jobs() <= MAX_JOBS
    True
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(round(cores - busy_cores()), MAX_JOBS))


def busy_cores(loadavg: str = "/proc/loadavg") -> float:
    """Other processes running now: the kernel's count of runnable tasks (the fourth field
    of ``/proc/loadavg``, ``running/total``) less this one. The one-minute load average,
    as ``make --load-average`` reads it, lags a minute behind: right after a long
    command it still counts that command's core as busy. Where the count cannot be read
    (not Linux), the load average; 0 where neither can.

    >>> import tempfile, pathlib
    >>> sample = pathlib.Path(tempfile.mkdtemp()) / "loadavg"
    >>> _ = sample.write_text("0.97 0.91 0.88 3/412 7781")
    >>> busy_cores(str(sample))
    2
    """
    try:
        running = int(Path(loadavg).read_text().split()[3].split("/")[0])
        return max(0, running - 1)
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.getloadavg()[0]
    except OSError:  # no load average here
        return 0.0


def can_fork() -> bool:
    """Whether workers can be forked here (Linux, with the ``fork`` start method)."""
    return sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()


class TraceWorkers:
    """``jobs`` worker processes forked from ``bench`` (call before it traces anything)."""

    def __init__(self, bench: Workbench, jobs: int) -> None:
        global _BENCH
        self.bench = bench
        self.jobs = jobs
        _BENCH = bench
        self.pool: Pool | None = multiprocessing.get_context("fork").Pool(jobs)

    def trace(self, recipes: list[Recipe]) -> int:
        """Trace ``recipes`` (none traced yet) in the workers, keeping each result in the
        bench; how many were traced so. Each worker is sent the short traces of its
        recipe's ``family`` that the bench holds, and a recipe whose family has none yet
        waits for the first of its family in ``recipes`` to make them (``waves``)."""
        if self.pool is None or len(recipes) < 2:
            return 0
        traced = 0
        for wave in waves(recipes, self.bench.short_traces_made()):
            kept = self.bench.short_traces_made()
            tasks = [(recipe, shared(kept, recipe)) for recipe in wave]
            for outcome in self.pool.imap(_trace_in_worker, tasks):
                if outcome == UNUSABLE:
                    self.close()  # this process traced before: one trace at a time from now on
                    return traced
                if outcome is not None:
                    self.bench.keep(*outcome)
                    traced += 1
        return traced

    def close(self) -> None:
        global _BENCH
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
            self.pool = None
        _BENCH = None


def start_workers(bench: Workbench, jobs: int) -> TraceWorkers | None:
    """Workers for ``bench``, or None where they cannot help (one job, not Linux)."""
    if jobs < 2 or not can_fork():
        return None
    return TraceWorkers(bench, jobs)


def _family(key: tuple) -> str | None:
    """The ``repeat_plan.family`` of a short trace's key (its short recipe is the last
    item, as ``trace/repeat.py`` keeps it)."""
    return family(json.loads(key[-1]))


def shared(kept: dict, recipe: Recipe) -> dict:
    """The short traces in ``kept`` that ``recipe`` can use: those of its family."""
    mine = family(recipe.to_json())
    return {} if mine is None else {k: v for k, v in kept.items() if _family(k) == mine}


def waves(recipes: list[Recipe], kept: dict) -> list[list[Recipe]]:
    """``recipes`` in one or two waves: the second holds the recipes whose family has no
    short traces in ``kept`` yet, save the first of each, which makes them (traced side
    by side, each would trace the same short traces).

    >>> from vramplan.recipe import Recipe
    >>> [[r.checkpointing for r in wave] for wave in waves(
    ...     [Recipe(checkpointing="11"), Recipe(checkpointing="21"), Recipe()], {})]
    [['11', 'none'], ['21']]
    """
    known = {_family(key) for key in kept}
    first: list[Recipe] = []
    later: list[Recipe] = []
    seen: set[str] = set()
    for recipe in recipes:
        mine = family(recipe.to_json())
        if mine is None or mine in known or mine not in seen:
            first.append(recipe)
            seen.add(mine or "")
        else:
            later.append(recipe)
    return [wave for wave in (first, later) if wave]


def _trace_in_worker(task: tuple[Recipe, dict]) -> tuple[Any, ...] | str | None:
    """In a worker: the recipe's estimate and trace, the label and seconds of the trace,
    and the short traces made for it (beside those ``task`` brings: the recipe and the
    short traces of its family the bench held); ``UNUSABLE`` when autograd cannot run in
    this process; None when the trace failed (the bench retries it)."""
    import torch

    recipe, brought = task
    bench = _BENCH
    assert bench is not None  # inherited from the parent at the fork
    bench.log.progress = None  # the parent reports each result
    torch.set_num_threads(1)  # the workers share the cores: no intra-op thread pools
    try:
        probe = torch.ones(1, requires_grad=True)
        (probe * 2).sum().backward()
    except RuntimeError:
        return UNUSABLE
    bench.short_traces_made().update(brought)
    already = set(bench.short_traces_made())
    start = time.perf_counter()
    try:
        estimate, trace = bench.run(recipe)
    except Exception:  # noqa: BLE001 - the parent traces it again and raises there
        return None
    seconds = time.perf_counter() - start
    made = {k: v for k, v in bench.short_traces_made().items() if k not in already}
    return recipe, estimate, trace, bench.label(recipe), seconds, made
