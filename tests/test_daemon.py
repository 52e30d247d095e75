"""``vramplan daemon``: a command handed to the warm daemon answers as it does alone.

One daemon (in a folder of its own) serves the module; every command runs as a user runs
it, ``python -m vramplan ...`` in a fresh process, and the daemon's own count of what it
served says whether the command went through it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vramplan.cli.daemon.key import environment_key

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the daemon forks and passes descriptors"
)

FACTORY = """
import time
import torch

def make():
    a = torch.randn(512, 512)
    (a @ a).sum()  # a real, multi-threaded CPU kernel in the daemon's child
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))

def slow():
    time.sleep(60)
    return make()
"""


def _vramplan(args: list[str], env: dict, cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vramplan", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        **kwargs,
    )


def _served(env: dict, cwd: Path) -> int:
    sock = next(Path(env["VRAMPLAN_DAEMON_DIR"]).glob("*.sock"))
    from vramplan.cli.daemon.client import connect
    from vramplan.cli.daemon.wire import send

    with connect(sock) as conn:
        send(conn, {"control": "status"})
        return json.loads(conn.makefile("rb").readline())["served"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    folder = tmp_path_factory.mktemp("daemon")
    (folder / "net.py").write_text(FACTORY)
    env = dict(os.environ, VRAMPLAN_DAEMON_DIR=str(folder / "run"), HF_HUB_OFFLINE="1")
    started = _vramplan(["daemon", "start", "--idle", "5"], env, folder)
    assert started.returncode == 0, started.stderr
    assert "ready in" in started.stdout
    yield env, folder
    stopped = _vramplan(["daemon", "stop"], env, folder)
    assert "stopped pid" in stopped.stdout
    assert not list((folder / "run").glob("*.sock"))


def test_a_command_through_the_daemon_answers_as_it_does_alone(daemon):
    env, folder = daemon
    args = ["estimate", "net.py:make", "--input-shape", "64", "-b", "4", "--json"]
    before = _served(env, folder)
    warm = _vramplan(args, env, folder)
    assert _served(env, folder) == before + 1
    cold = _vramplan(args, dict(env, VRAMPLAN_DAEMON="off"), folder)
    assert _served(env, folder) == before + 1
    assert warm.returncode == cold.returncode == 0, warm.stderr
    warm_json, cold_json = json.loads(warm.stdout), json.loads(cold.stdout)
    assert warm_json["peak"] == cold_json["peak"]
    assert warm_json["components"] == cold_json["components"]


def test_a_refusal_through_the_daemon_is_one_line_and_exit_2(daemon):
    env, folder = daemon
    before = _served(env, folder)
    done = _vramplan(["estimate", "torchvision:nope", "-b", "2"], env, folder)
    assert _served(env, folder) == before + 1
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert done.stderr.startswith("vramplan: error: unknown torchvision model 'nope'")


def test_another_environment_runs_the_command_itself(daemon):
    env, folder = daemon
    other = dict(env, HF_HUB_OFFLINE="0")
    assert environment_key(other) != environment_key(env)
    before = _served(env, folder)
    done = _vramplan(["check", "net.py:make", "--input-shape", "64", "--gpu", "t4"], other, folder)
    assert done.returncode == 0, done.stderr
    assert _served(env, folder) == before


def test_ctrl_c_reaches_the_command_in_the_daemon(daemon):
    env, folder = daemon
    client = subprocess.Popen(
        [sys.executable, "-m", "vramplan", "estimate", "net.py:slow", "--input-shape", "64"],
        env=env,
        cwd=folder,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    before = _served(env, folder)
    deadline = time.monotonic() + 60
    while _served(env, folder) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _served(env, folder) == before + 1
    client.send_signal(signal.SIGINT)
    assert client.wait(timeout=60) == 128 + signal.SIGINT, client.stderr.read()


def test_auto_starts_a_daemon_after_a_command_that_found_none(tmp_path):
    (tmp_path / "net.py").write_text(FACTORY)
    env = dict(
        os.environ,
        VRAMPLAN_DAEMON_DIR=str(tmp_path / "run"),
        VRAMPLAN_DAEMON="auto",
        HF_HUB_OFFLINE="1",
    )
    args = ["check", "net.py:make", "--input-shape", "64", "--gpu", "t4"]
    try:
        first = _vramplan(args, env, tmp_path)
        assert first.returncode == 0, first.stderr
        deadline = time.monotonic() + 240
        while not list((tmp_path / "run").glob("*.sock")) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _served(env, tmp_path) == 0  # started after the first command, not by it
        second = _vramplan(args, env, tmp_path)
        assert second.returncode == 0, second.stderr
        assert _served(env, tmp_path) == 1
        assert second.stdout == first.stdout
    finally:
        _vramplan(["daemon", "stop"], env, tmp_path)
