"""Run one measurement in a fresh Python process (CUDA state cannot be reset in-process) and
read back the JSON it prints on a line of its own after ``MARKER``::

    >>> import sys
    >>> run_child(["-c", "from benchmarks.gpu_harvest.child import emit; emit({'x': 1})"])
    {'x': 1}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

MARKER = "VRAMPLAN_HARVEST_JSON "
ROOT = Path(__file__).resolve().parents[2]  # the repository: children import benchmarks.*


def emit(result: dict) -> None:
    """Print ``result`` for the parent (the last such line wins)."""
    sys.stdout.write(MARKER + json.dumps(result) + "\n")
    sys.stdout.flush()


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


def run_child(args: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> dict:
    """``python ARGS`` in the repository root; its emitted dict, or ``{"error": ...}``."""
    try:
        done = subprocess.run(
            [sys.executable, *args],
            cwd=ROOT,
            env=child_env(env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    found = [line for line in done.stdout.splitlines() if line.startswith(MARKER)]
    if found:
        result = json.loads(found[-1][len(MARKER) :])
        if done.returncode != 0:
            result["exit_code"] = done.returncode
        return result
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return {"error": f"exit code {done.returncode}: " + " | ".join(tail)}
