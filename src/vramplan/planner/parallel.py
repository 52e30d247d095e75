"""Traces of one workbench run side by side, in worker processes forked from it.

``plan`` and ``max-batch`` know several recipes they will need before they need them (the
levers of the table, the floors of each base, a search's next candidates), and others
they may need next. Each trace is single-threaded Python, so on a machine with cores to
spare those recipes are traced at once: workers forked from the bench trace them while
the bench goes on, and send back each estimate with its trace when the bench asks for it.
Recipes it may need are traced only on workers that would be idle. The bench and the
workers share the short traces of repeated blocks they make (``shared_traces.py``): two
counts of checkpointed blocks traced at once trace each short trace once. The answer is
the same as tracing them one after another; only the wall-clock changes::

    with bench.side_by_side(Recipe(batch_size=8)):   # workers forked here, before any trace
        bench.prefetch([Recipe(batch_size=8), Recipe(batch_size=16)])
        bench.estimate(Recipe(batch_size=16))   # waits for the worker tracing it

The workers are forked before the bench traces anything: PyTorch's autograd engine
refuses to run backward in a process forked after its parent ran one (its device threads
do not survive a fork: https://github.com/pytorch/pytorch/wiki/Autograd-and-Fork). A
process that has traced a training step forks no workers (``trace/autograd_fork.py``); a
worker that finds its autograd unusable all the same (the user's own backward on a GPU)
says so, and the bench goes on one trace at a time. Forking is used only on Linux;
elsewhere, or with one job, nothing runs here and the bench traces each recipe when it is
asked for. A recipe whose trace fails in a worker is left to the bench, which traces it
again and raises its error in the caller; so is one whose worker died or hangs, and the
bench goes on alone: a lost worker never leaves the bench waiting.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from vramplan.limits import user_code_limit
from vramplan.planner.shared_traces import ShortTraceStore
from vramplan.trace.autograd_fork import forked_autograd_runs
from vramplan.trace.packed import PackedTrace

if TYPE_CHECKING:
    from vramplan.recipe import Recipe


class Workbench(Protocol):
    """What the workers need of ``bench.Workbench`` (which imports this module)."""

    log: Any

    def run(self, recipe: Recipe) -> tuple[Any, Any]: ...

    def keep(self, *outcome: Any) -> None: ...

    def label(self, recipe: Recipe) -> str: ...

    def key(self, recipe: Recipe) -> str: ...

    def has(self, key: str) -> bool: ...

    def short_traces_made(self) -> dict: ...

    def use_short_traces(self, store: dict) -> None: ...

    def in_worker(self) -> None: ...


MAX_JOBS = 8
"""Workers at most by default: each builds and traces its own copy of the model (a worker
of a 405B-parameter model's plan grows by a few hundred MiB)."""
UNUSABLE = "autograd unusable after fork"
"""A worker's answer when its autograd engine refuses to run (see the module docstring)."""
LOST = "worker lost"
"""What a recipe whose worker died, or did not answer within ``patience``, comes back as."""

SAMPLES = 5
SAMPLE_GAP = 0.004
"""``busy_cores`` reads the runnable count this many times, this many seconds apart."""

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


def busy_cores(loadavg: str = "/proc/loadavg", samples: int = SAMPLES) -> float:
    """Other processes running now: the kernel's count of runnable tasks (the fourth field
    of ``/proc/loadavg``, ``running/total``) less this one, the least of ``samples``
    readings ``SAMPLE_GAP`` seconds apart. One reading is an instant: a kernel thread or a
    short process that happens to be runnable then counts as a busy core (a 2-core machine
    would trace in one process); a process that keeps a core busy is runnable in every
    reading. The one-minute load average, as ``make --load-average`` reads it, lags a
    minute behind: right after a long command it still counts that command's core as
    busy. Where the count cannot be read (not Linux), the load average; 0 where neither
    can.

    >>> import tempfile, pathlib
    >>> sample = pathlib.Path(tempfile.mkdtemp()) / "loadavg"
    >>> _ = sample.write_text("0.97 0.91 0.88 3/412 7781")
    >>> busy_cores(str(sample))
    2
    """
    try:
        readings = []
        for i in range(samples):
            if i:
                time.sleep(SAMPLE_GAP)
            readings.append(int(Path(loadavg).read_text().split()[3].split("/")[0]))
        return max(0, min(readings) - 1)
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
    """``jobs`` worker processes forked from ``bench`` (call before it traces anything).
    Each recipe sent to them is traced while the bench goes on; the bench waits for it
    only when it asks for it (``wait``). Recipes it may ask for later (``ahead``) start
    as workers come free, never more at once than leave ``jobs`` processes tracing, the
    bench's own trace counted (``tracing_here``).

    Each worker has a pipe of its own and a thread here that hands it one recipe at a time
    (``_feed``): no lock is shared between processes, a worker that dies (the kernel's
    out-of-memory killer) ends its pipe and its recipe comes back as ``LOST``, and
    ``close`` kills the workers outright. A recipe the bench waits for longer than
    ``patience`` allows is taken back: the bench traces it, and the rest, itself."""

    def __init__(self, bench: Workbench, jobs: int) -> None:
        global _BENCH
        self.bench = bench
        self.folder = Path(tempfile.mkdtemp(prefix="vramplan-short-traces-"))
        """Where the bench and its workers share the short traces they make."""
        bench.use_short_traces(ShortTraceStore(self.folder, bench.short_traces_made()))
        self.running: dict[str, Recipe] = {}
        """The recipes sent and not yet waited for, by the bench's key."""
        self.sent: list[Recipe] = []
        """Recipes sent that no worker has taken yet, first sent first."""
        self.queued: list[Recipe] = []
        """Recipes the bench may ask for next, to start as workers come free."""
        self.outcomes: dict[str, tuple | str | None] = {}
        """What the workers sent back for recipes not yet waited for, by key."""
        self.here = 0
        """Traces the bench runs itself now (0 or 1)."""
        self.closed = False
        self._changed = threading.Condition()
        _BENCH = bench
        context = multiprocessing.get_context("fork")
        self.workers = [_Worker(context) for _ in range(jobs)]  # forked before any thread
        self._feeders = [
            threading.Thread(target=self._feed, args=(worker,), daemon=True)
            for worker in self.workers
        ]
        for feeder in self._feeders:
            feeder.start()

    @property
    def jobs(self) -> int:
        """Workers alive and in use (0 once closed)."""
        return 0 if self.closed else sum(worker.alive for worker in self.workers)

    def trace(self, recipes: list[Recipe], ahead: list[Recipe]) -> Recipe | None:
        """Send the ``recipes`` the bench has not traced to the workers, and queue
        ``ahead`` (recipes it may ask for next, likeliest first, in place of those queued
        before) to start on workers that would otherwise be idle. A single recipe is left
        to the bench, returned for it to trace at once (no result to send back) while a
        worker traces one of ``ahead``; so is the last of several where workers still
        tracing what was sent before (what was ahead) leave fewer free than they need: the
        bench would only wait."""
        self.collect()
        with self._changed:
            if self.closed:
                return None
            needed = self._new(recipes)
            busy = self._busy()
            short = busy and len(needed) > max(0, self.jobs - busy)
            here = needed[-1] if needed and (len(needed) == 1 or short) else None
            for recipe in needed:
                if recipe is not here:
                    self.running[self.bench.key(recipe)] = recipe
                    self.sent.append(recipe)
            self.queued = [r for r in self._new(ahead) if r not in needed]
            self.here = int(here is not None)  # the bench traces it next (``tracing_here``)
            self._fill()
            self._changed.notify_all()
            return here

    def _new(self, recipes: list[Recipe]) -> list[Recipe]:
        """``recipes`` neither traced nor running, once each."""
        new: dict[str, Recipe] = {}
        for recipe in recipes:
            key = self.bench.key(recipe)
            if not self.bench.has(key) and key not in self.running:
                new.setdefault(key, recipe)
        return list(new.values())

    def _busy(self) -> int:
        """Recipes sent and not yet traced: running on a worker, or waiting for one."""
        return sum(key not in self.outcomes for key in self.running)

    def _fill(self) -> None:
        """Send queued recipes while fewer than ``jobs`` processes would trace: the
        workers' traces, the recipes sent that no worker has taken yet, and the bench's
        own. Call with the lock held."""
        tracing = sum(worker.key is not None for worker in self.workers)
        tracing += len(self.sent) + self.here
        while self.queued and tracing < self.jobs:
            for recipe in self._new([self.queued.pop(0)]):
                self.running[self.bench.key(recipe)] = recipe
                self.sent.append(recipe)
                tracing += 1

    def _next(self) -> Recipe | None:
        """The recipe a free worker takes now, if any. Call with the lock held."""
        if self.closed:
            return None
        self._fill()
        return self.sent.pop(0) if self.sent else None

    def _feed(self, worker: _Worker) -> None:
        """In a thread of the bench's process: hand ``worker`` the recipes it takes
        (``_next``) one at a time and keep what it sends back, until the workers close or
        it dies."""
        while True:
            with self._changed:
                recipe = self._next()
                while recipe is None:
                    if self.closed:
                        return
                    self._changed.wait()
                    recipe = self._next()
                worker.key = self.bench.key(recipe)
            outcome = worker.trace(recipe)
            with self._changed:
                self.outcomes[worker.key] = outcome
                worker.key = None
                worker.alive = outcome != LOST
                self._changed.notify_all()
            if not worker.alive:
                return

    @contextlib.contextmanager
    def tracing_here(self) -> Iterator[None]:
        """The bench traces a recipe itself within the block: one worker fewer starts."""
        with self._changed:
            self.here = 1
        try:
            yield
        finally:
            with self._changed:
                self.here = 0
                self._changed.notify_all()

    def wait(self, key: str) -> None:
        """Wait for the recipe running under ``key`` (if any) and keep its result in the
        bench. A trace that failed, or whose worker died, is left to the bench, which
        traces it again; so is one not back within ``patience``, and the workers close
        (one of them hangs): the bench traces one recipe at a time from then on."""
        deadline = patience()
        if deadline is not None:
            deadline += time.monotonic()
        with self._changed:
            if key not in self.running:
                return
            while key not in self.outcomes and self.jobs:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._changed.wait(left)
            self.running.pop(key)
            outcome = self.outcomes.pop(key, LOST)
        if self._keep(outcome) in (UNUSABLE, LOST):
            self.close()  # autograd unusable, a worker lost or hung: one trace at a time

    def collect(self) -> None:
        """Keep the results that have come in."""
        with self._changed:
            ready = [key for key in self.running if key in self.outcomes]
        for key in ready:
            self.wait(key)

    def _keep(self, outcome: tuple | str | None) -> tuple | str | None:
        if isinstance(outcome, tuple):
            self.bench.keep(*outcome)
        return outcome

    def close(self) -> None:
        """Keep the results that have come in, kill the workers (and the traces still
        running: nothing asked for them) and remove the shared folder."""
        global _BENCH
        with self._changed:  # no recipe starts from here on
            if self.closed:
                return
            self.closed = True
            self.sent, self.queued = [], []
            arrived = [self.outcomes.pop(key) for key in self.running if key in self.outcomes]
            self.running = {}
            self._changed.notify_all()
        for outcome in arrived:
            self._keep(outcome)
        for worker in self.workers:
            worker.stop()
        for feeder in self._feeders:
            feeder.join()
        for worker in self.workers:
            worker.pipe.close()  # once no feeder reads it
        self.bench.use_short_traces(dict(self.bench.short_traces_made()))
        shutil.rmtree(self.folder, ignore_errors=True)
        _BENCH = None


class _Worker:
    """One process forked from the bench that traces the recipes sent over its own pipe,
    one at a time (``_serve``)."""

    def __init__(self, context: Any) -> None:
        self.pipe, theirs = context.Pipe()
        self.process = context.Process(target=_serve, args=(theirs,), daemon=True)
        self.process.start()
        theirs.close()  # the worker holds the only other end: its death ends the pipe
        self.key: str | None = None
        """The bench's key of the recipe it traces now."""
        self.alive = True

    def trace(self, recipe: Recipe) -> tuple | str | None:
        """What the worker sends back for ``recipe``; ``LOST`` where it died (or was
        killed) before it answered."""
        try:
            self.pipe.send(recipe)
            return self.pipe.recv()
        except (EOFError, OSError):
            return LOST

    def stop(self) -> None:
        """Kill the process and reap it (its pipe ends: a thread waiting on it goes on)."""
        self.process.kill()
        self.process.join()


def patience() -> float | None:
    """Seconds the bench waits for a worker's recipe before it takes it back: a recipe's
    build and its trace each run under the user-code limit (``limits.py``; a worker whose
    trace passes it sends the failure back), so twice the limit passes only where the
    worker hangs. None where the user lifted the limit.

    >>> from vramplan.limits import user_code_timeout
    >>> with user_code_timeout(2.5):
    ...     patience()
    5.0
    """
    limit = user_code_limit()
    return None if limit is None else 2 * limit


def start_workers(bench: Workbench, jobs: int) -> TraceWorkers | None:
    """Workers for ``bench``, or None where they cannot help: one job, not Linux, or a
    process whose autograd has run a traced backward (a worker forked from it could not:
    ``trace/autograd_fork.py``)."""
    if jobs < 2 or not can_fork() or not forked_autograd_runs():
        return None
    return TraceWorkers(bench, jobs)


def _serve(pipe: Any) -> None:
    """A worker's life: trace each recipe that comes over ``pipe``, send back the answer,
    until the bench closes its end."""
    while True:
        try:
            recipe = pipe.recv()
        except EOFError:
            return
        pipe.send(_trace_in_worker(recipe))


def _trace_in_worker(recipe: Recipe) -> tuple[Any, ...] | str | None:
    """In a worker: the recipe's estimate and packed trace (``trace/packed.py``), and the
    label and seconds of the trace (its short traces are shared through the folder);
    ``UNUSABLE`` when autograd cannot run in this process; None when the trace failed (the
    bench retries it)."""
    import torch

    bench = _BENCH
    assert bench is not None  # inherited from the parent at the fork
    bench.in_worker()  # a worker traces what it is sent itself
    bench.log.progress = None  # the parent reports each result
    torch.set_num_threads(1)  # the workers share the cores: no intra-op thread pools
    try:
        probe = torch.ones(1, requires_grad=True)
        (probe * 2).sum().backward()
    except RuntimeError:
        return UNUSABLE
    start = time.perf_counter()
    try:
        estimate, trace = bench.run(recipe)
    except Exception:  # noqa: BLE001 - the parent traces it again and raises there
        return None
    seconds = time.perf_counter() - start
    return recipe, estimate, PackedTrace.of(trace), bench.label(recipe), seconds
