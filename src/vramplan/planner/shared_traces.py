"""Short traces of repeated blocks shared between the workers that trace side by side.

Recipes of one family (``repeat_plan.family``: they differ only in how many leading blocks
recompute, as ``plan``'s search for the fewest checkpointed blocks asks) are rebuilt from
the same short traces (``trace/repeat.py``). Traced in two workers at once, each would
trace all of them. Instead a process claims a short trace before tracing it (a file made
only where none is), publishes it when done, and waits for the ones another claimed: two
workers trace half each. The folder is private to one ``plan`` (made by the bench before
its workers fork, removed when they close)::

    store = ShortTraceStore(folder, kept)       # in each process, over the same folder
    if store.claim(key):
        store[key] = trace_it()                 # published for the others
    elif store.wait(key):
        trace = store[key]                      # traced by another worker
"""

from __future__ import annotations

import hashlib
import os
import pickle
import time
from pathlib import Path

WAIT = 900.0
"""Seconds a worker waits for a short trace another one claimed before tracing it itself
(the claimant traces it in seconds; one that dies is seen at once: ``running``)."""
POLL = 0.02
"""Seconds between looks for a claimed short trace."""


class ShortTraceStore(dict):
    """The short traces a process holds (a dict, as ``BuiltModel.short_traces``), and those
    the others publish in ``folder``, read as they are asked for; each it sets is
    published."""

    def __init__(self, folder: Path, kept: dict) -> None:
        super().__init__(kept)
        self.folder = folder

    def _path(self, key: tuple, suffix: str) -> Path:
        return self.folder / (hashlib.sha256(repr(key).encode()).hexdigest()[:40] + suffix)

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, key) or self._load(key)

    def _load(self, key: object) -> bool:
        """Read ``key``'s trace if another worker has published it."""
        try:
            with self._path(key, ".trace").open("rb") as file:
                trace = pickle.load(file)  # written by a worker of this plan (``__setitem__``)
        except FileNotFoundError:
            return False
        dict.__setitem__(self, key, trace)
        return True

    def __setitem__(self, key: tuple, trace: object) -> None:
        dict.__setitem__(self, key, trace)
        partial = self._path(key, f".{os.getpid()}.part")
        with partial.open("wb") as file:
            pickle.dump(trace, file, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(partial, self._path(key, ".trace"))  # whole, or not there at all

    def claim(self, key: tuple) -> bool:
        """Whether this worker is the first to claim ``key`` (then it traces it); the
        claim names its process."""
        try:
            claim = os.open(self._path(key, ".claim"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        with os.fdopen(claim, "w") as file:
            file.write(str(os.getpid()))
        return True

    def release(self, key: tuple) -> None:
        """This worker's trace of a claimed ``key`` failed: the others trace it themselves."""
        self._path(key, ".failed").touch()

    def wait(self, key: tuple, timeout: float = WAIT) -> bool:
        """Wait until another worker publishes ``key``'s trace; False where it gave it up
        (``release``), died before it published it, or ``timeout`` passed (then the caller
        traces it)."""
        deadline = time.monotonic() + timeout
        while key not in self:
            if self._given_up(key) or time.monotonic() > deadline:
                return False
            time.sleep(POLL)
        return True

    def _given_up(self, key: tuple) -> bool:
        if self._path(key, ".failed").exists():
            return True
        try:
            claimant = int(self._path(key, ".claim").read_text())
        except (OSError, ValueError):  # its name not written yet
            return False
        return not running(claimant)


def running(pid: int) -> bool:
    """Whether process ``pid`` runs: neither ended nor a zombie its parent has not reaped
    (Linux's ``/proc``, where workers are forked).

    >>> running(os.getpid()), running(2**22 + 1)  # past Linux's largest pid
    (True, False)
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
