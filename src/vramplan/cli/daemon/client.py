"""The command's side: hand the command to the daemon of this environment, if one listens.

``forward`` returns the command's exit code when a daemon ran it, or None when the
command should run here (no daemon of this environment, a command a daemon does not
answer, ``VRAMPLAN_DAEMON=off``). The daemon's child writes to this process's own
terminal (its descriptors are passed along), and signals this process receives (Ctrl-C)
are passed on to it. Only ``socket`` and the standard library are imported here.

    >>> forward(["calc", "--params", "7B"], {})   # never a daemon's: answered here
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

from vramplan.cli.daemon.key import ROUTED, SWITCH_ENV, daemon_dir, socket_path
from vramplan.cli.daemon.launch import let_go, spawn
from vramplan.cli.daemon.wire import send

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
LOST = 1
"""The exit code when the daemon's child ended without an answer (killed)."""


def _routed(argv: list[str], environ: Mapping[str, str], switch: str) -> bool:
    """Whether ``argv`` is a traced command (``ROUTED``) and ``VRAMPLAN_DAEMON`` allows the
    daemon: anything but ``off`` to use one, ``auto`` to start one."""
    if not argv or argv[0] not in ROUTED:
        return False
    value = environ.get(SWITCH_ENV, "").lower()
    return value == "auto" if switch == "auto" else value != "off"


def _wanted(argv: list[str], environ: Mapping[str, str]) -> bool:
    if not _routed(argv, environ, "use"):
        return False
    folder = daemon_dir(environ)
    return folder.is_dir() and any(folder.glob("*.sock"))


def connect(path: os.PathLike) -> socket.socket | None:
    """A connection to the daemon listening at ``path``; None (and the stale socket file
    removed) when none does."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(os.fspath(path))
    except FileNotFoundError:
        sock.close()
        return None
    except ConnectionRefusedError:  # the daemon ended without removing its socket
        sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return None
    return sock


class _Relay:
    """Signals to this process, passed on to the daemon's child running the command (held
    until its pid is known, so a Ctrl-C right after Enter is not lost)."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.held: list[int] = []

    def __call__(self, signum: int, _frame) -> None:
        if self.pid is None:
            self.held.append(signum)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def to(self, pid: int) -> None:
        self.pid = pid
        for signum in self.held:
            self(signum, None)


@contextlib.contextmanager
def _relayed() -> Iterator[_Relay]:
    relay = _Relay()
    before = {s: signal.signal(s, relay) for s in FORWARDED}
    try:
        yield relay
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    if relay.pid is None and relay.held:  # the daemon never took the command
        raise KeyboardInterrupt


def start_after(argv: list[str], environ: Mapping[str, str]) -> None:
    """Under ``VRAMPLAN_DAEMON=auto``, after a traced command that found no daemon: start
    one in the background for the next command (not waited for)."""
    if not _routed(argv, environ, "auto"):
        return
    path = socket_path(environ)
    if path.exists() or any(_alive(p) for p in path.parent.glob(f"{path.stem}.*.tmp")):
        return  # one is listening, or warming up
    let_go(spawn(path, environ))


def _alive(staging: Path) -> bool:
    """Whether the daemon that bound ``staging`` (``KEY.PID.tmp``) is still warming up."""
    try:
        os.kill(int(staging.suffixes[-2][1:]), 0)
    except (ProcessLookupError, ValueError, IndexError):
        return False
    except PermissionError:  # alive, and another user's
        return True
    return True


def forward(argv: list[str], environ: Mapping[str, str]) -> int | None:
    """Run ``argv`` in the daemon of this environment; its exit code, or None when there
    is none to run it."""
    if not _wanted(argv, environ):
        return None
    sock = connect(socket_path(environ))
    if sock is None:
        return None
    with sock:
        request = {"argv": argv, "cwd": os.getcwd(), "env": dict(environ), "path0": sys.path[0]}
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        with _relayed() as relay:
            send(sock, request, (0, 1, 2))
            replies = sock.makefile("rb")
            started = replies.readline()
            if not started:
                return None  # the daemon refused (another user, or it is stopping): run here
            relay.to(json.loads(started)["pid"])
            ended = replies.readline()
        if not ended:
            print("vramplan: error: the daemon's process ended without an answer", file=sys.stderr)
            return LOST
        return int(json.loads(ended)["exit"])
