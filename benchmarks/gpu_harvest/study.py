"""The two existing GPU runs the harvest drives as subprocesses: the accuracy study
(``python -m benchmarks.accuracy.run --device cuda``) and ``vramplan calibrate``. Each
result keeps the command, exit code, time and the paths it wrote::

    >>> written_path("resnet18-sgd  ok\\nwrote /tmp/x/cuda-H100-2026-01-01.csv\\n")
    '/tmp/x/cuda-H100-2026-01-01.csv'
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.gpu_harvest.child import ROOT, child_env


def written_path(stdout: str) -> str | None:
    """The path of the study's ``wrote PATH`` line, if it printed one."""
    lines = [line for line in stdout.splitlines() if line.startswith("wrote ")]
    return lines[-1].removeprefix("wrote ").strip() if lines else None


def _run(command: list[str], timeout: float) -> dict:
    start = time.perf_counter()
    out = {"command": " ".join(command[1:] if command[0] == sys.executable else command)}
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        out.update(error=f"timed out after {timeout:.0f} s", stdout_tail=stdout[-2000:])
        out["seconds"] = round(time.perf_counter() - start, 1)
        return out
    out.update(
        exit_code=done.returncode,
        seconds=round(time.perf_counter() - start, 1),
        stdout=done.stdout,
        stderr_tail=done.stderr[-2000:],
    )
    return out


def run_accuracy_study(folder: Path, quick: bool, timeout: float, jobs: int = 1) -> dict:
    """The accuracy study on CUDA, ``jobs`` fresh processes at a time, its CSV and summary
    written under ``folder``."""
    command = [sys.executable, "-m", "benchmarks.accuracy.run", "--device", "cuda"]
    command += ["--output", str(folder), "--jobs", str(jobs)] + (["--quick"] if quick else [])
    out = _run(command, timeout)
    csv_path = written_path(out.get("stdout", ""))
    if csv_path:
        out["csv"] = csv_path
        out["md"] = str(Path(csv_path).with_suffix(".md"))
    out["stdout_tail"] = out.pop("stdout", "")[-3000:] or out.get("stdout_tail", "")
    return out


def run_calibrate(folder: Path, timeout: float = 300) -> dict:
    """``vramplan calibrate --output folder``, with the profile it saved."""
    command = [sys.executable, "-m", "vramplan", "calibrate", "--output", str(folder), "--json"]
    out = _run(command, timeout)
    stdout = out.pop("stdout", "")
    try:
        profile = json.loads(stdout[stdout.index("{") :])
    except ValueError:
        out["stdout_tail"] = stdout[-2000:]
        return out
    out["path"] = profile.pop("path", None)
    out["profile"] = profile
    return out
