"""Start a daemon for this environment in the background (``vramplan daemon start``, or
after a command under ``VRAMPLAN_DAEMON=auto``).

The daemon runs in a session of its own (a Ctrl-C at the terminal does not reach it), in
its socket's folder (so nothing in the user's directory shadows a library it imports),
with its output in a log beside the socket. Only this user can open the folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

IDLE_MINUTES = 30.0


def spawn(
    path: Path, environ: Mapping[str, str], idle_minutes: float = IDLE_MINUTES
) -> subprocess.Popen:
    """A daemon process for the environment ``environ`` (the one its key was made from)
    that will listen at ``path`` once warm (not waited for)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path.parent, 0o700)
    with open(path.with_suffix(".log"), "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "vramplan.cli.daemon.server", "--socket", str(path)]
            + ["--idle", str(idle_minutes * 60)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            cwd=path.parent,
            env=dict(environ),
            start_new_session=True,
        )


def let_go(daemon: subprocess.Popen) -> None:
    """Leave ``daemon`` running after this process ends. ``Popen`` warns "subprocess is
    still running" when collected unwaited; this one is meant to outlive us."""
    daemon.returncode = 0
