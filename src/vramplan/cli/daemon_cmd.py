"""``vramplan daemon start|stop|status``: a warm process for the commands that trace.

$ vramplan daemon start
vramplan daemon: ready in 9.8 s (pid 4242); estimate, check, max-batch, plan and serve in
this environment now start warm; it stops after 30 min unused (vramplan daemon stop)
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Annotated

import typer

from vramplan import UserError
from vramplan.cli.app import app
from vramplan.cli.daemon.client import connect
from vramplan.cli.daemon.key import daemon_dir, socket_path
from vramplan.cli.daemon.launch import IDLE_MINUTES, let_go, spawn
from vramplan.cli.daemon.wire import send

ACTIONS = ("start", "stop", "status")
READY_WAIT = 300.0
"""Seconds ``start`` waits for the daemon's imports and warm-up (about one cold command)."""


def _ask(path: Path, control: str) -> dict | None:
    """A daemon's own account of itself (``status``), or its stop; None if none listens."""
    sock = connect(path)
    if sock is None:
        return None
    with sock:
        send(sock, {"control": control})
        line = sock.makefile("rb").readline()
    return json.loads(line) if line else None


def _describe(info: dict, current: str) -> str:
    age = time.time() - info["started"]
    mine = "this environment" if info["key"] == current else "another environment"
    return (
        f"pid {info['pid']} ({mine}): up {age / 60:.0f} min, {info['served']} commands, "
        f"stops after {info['idle'] / 60:.0f} min unused"
    )


def _start(idle_minutes: float) -> int:
    path = socket_path(os.environ)
    running = _ask(path, "status")
    if running is not None:
        print(f"vramplan daemon: already running, {_describe(running, path.stem)}")
        return 0
    began = time.monotonic()
    daemon = spawn(path, os.environ, idle_minutes)
    while not path.exists():
        if daemon.poll() is not None or time.monotonic() - began > READY_WAIT:
            daemon.kill()
            raise UserError(f"the daemon did not start; its log: {path.with_suffix('.log')}")
        time.sleep(0.1)
    pid = daemon.pid
    let_go(daemon)
    print(
        f"vramplan daemon: ready in {time.monotonic() - began:.1f} s (pid {pid}); "
        "estimate, check, max-batch, plan and serve in this environment now start warm; "
        f"it stops after {idle_minutes:g} min unused (vramplan daemon stop)"
    )
    return 0


def _stop() -> int:
    folder = daemon_dir(os.environ)
    stopped = [info for p in sorted(folder.glob("*.sock")) if (info := _ask(p, "stop"))]
    for info in stopped:
        print(f"vramplan daemon: stopped pid {info['pid']}")
    if not stopped:
        print("vramplan daemon: none running")
    return 0


def _status() -> int:
    folder = daemon_dir(os.environ)
    current = socket_path(os.environ).stem
    found = [info for p in sorted(folder.glob("*.sock")) if (info := _ask(p, "status"))]
    for info in found:
        print(f"vramplan daemon: {_describe(info, current)}")
    if not any(info["key"] == current for info in found):
        print("vramplan daemon: none for this environment (vramplan daemon start)")
    return 0


@app.command("daemon")
def daemon_command(
    action: Annotated[str, typer.Argument(help="start, stop (every daemon) or status")],
    idle: Annotated[
        float, typer.Option("--idle", help="minutes unused after which the daemon stops")
    ] = IDLE_MINUTES,
) -> int:
    """Keep torch and the model libraries imported in a background process, so that
    estimate, check, max-batch, plan and serve start in a fraction of a second."""
    if action not in ACTIONS:
        raise UserError(f"daemon action must be one of {', '.join(ACTIONS)}, got {action!r}")
    if not idle > 0:
        raise UserError(f"--idle must be a positive number of minutes, got {idle}")
    if action == "start":
        return _start(idle)
    return _stop() if action == "stop" else _status()
