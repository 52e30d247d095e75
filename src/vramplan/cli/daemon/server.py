"""The daemon's side: import once, then fork a fresh child for every command.

``python -m vramplan.cli.daemon.server --socket PATH --idle SECONDS`` imports the
command line, torch and the model libraries, runs one forward pass of a small model with
fake tensors (the lazy imports and first-call caches of a trace), and only then listens
at ``PATH``, so a command never waits on a cold daemon. Each request forks a child that
takes the command's terminal, directory, environment and arguments, runs it as
``vramplan`` would, and sends back its exit code. The daemon never runs a backward pass:
PyTorch's autograd engine refuses to run in a process forked after its parent ran one
(https://github.com/pytorch/pytorch/wiki/Autograd-and-Fork), and the children must be
able to trace. It ends after ``SECONDS`` without a request, on ``vramplan daemon stop``,
or when its socket file is removed.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import io
import json
import os
import select
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from vramplan.cli.daemon.wire import receive, send

WARM_UP = (
    ["estimate", "torchvision:resnet18", "-b", "2", "--input-shape", "3x32x32", "--mode", "infer"],
    ["estimate", "hf:openai-community/gpt2", "--seq-len", "8", "-b", "1", "--mode", "infer"],
)
"""Forward-only estimates run once before listening (no backward: see the docstring)."""


def _peer_is_me(conn: socket.socket) -> bool:
    """Whether the process at the other end runs as this user (Linux's ``SO_PEERCRED``;
    elsewhere the socket folder's permissions alone keep others out)."""
    if not hasattr(socket, "SO_PEERCRED"):
        return True
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1] == os.getuid()


OPTIONAL = ("diffusers", "peft", "timm")
"""Model libraries the warm-up estimates do not load, imported when installed (diffusers
alone is about 5 s: its model modules probe for peft, bitsandbytes and accelerate)."""
DIFFUSERS_CLASSES = ("UNet2DConditionModel", "DiTTransformer2DModel", "AutoencoderKL")


def warm_up() -> None:
    """Import what the commands import and run the forward-only ``WARM_UP`` estimates,
    their output discarded (a missing optional library only skips its estimate)."""
    from vramplan.cli import main, register_commands

    register_commands()  # every command, so that a forked child imports none

    for name in OPTIONAL:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    for name in DIFFUSERS_CLASSES:  # diffusers imports each model module when first named
        with contextlib.suppress(Exception):
            getattr(sys.modules["diffusers"], name)

    for argv in WARM_UP:
        quiet = io.StringIO()
        with (
            contextlib.redirect_stdout(quiet),
            contextlib.redirect_stderr(quiet),
            contextlib.suppress(SystemExit),
        ):
            main(argv)


def _streams() -> None:
    """Python's standard streams rebuilt on descriptors 0-2 (now the command's)."""
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False, buffering=1 if os.isatty(1) else -1)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", closefd=False, buffering=1)  # noqa: SIM115


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def run_child(request: dict, fds: list[int]) -> int:
    """In the forked child: become the command (its streams, directory, environment) and
    run it; its exit code."""
    from vramplan.cli import main

    for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
    for fd in fds:
        os.close(fd)
    _streams()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = request["path0"]
    sys.argv = ["vramplan", *request["argv"]]
    try:
        code = main(request["argv"])
    except SystemExit as exc:
        code = _exit_code(exc)
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError):
            stream.flush()
    return code


@dataclass
class Daemon:
    """One listening daemon: what ``vramplan daemon status`` reports, and the commands it
    is running (its forked children)."""

    path: Path
    idle: float
    listener: socket.socket
    pid: int = field(default_factory=os.getpid)
    started: float = field(default_factory=time.time)
    served: int = 0
    children: set[int] = field(default_factory=set)

    def info(self) -> dict:
        return {
            "pid": self.pid,
            "started": self.started,
            "served": self.served,
            "idle": self.idle,
            "key": self.path.stem,
            "path": str(self.path),
        }

    def answer(self, conn: socket.socket) -> bool:
        """Serve one connection; False when the daemon should stop."""
        request, fds = receive(conn)
        if request is None or not _peer_is_me(conn):
            for fd in fds:
                os.close(fd)
            return True
        if "control" in request:
            send(conn, self.info())
            return request["control"] != "stop"
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                self.listener.close()
                send(conn, {"pid": os.getpid()})
                code = run_child(request, fds)
            except KeyboardInterrupt:  # a Ctrl-C before the command had begun
                code = 128 + signal.SIGINT
            finally:
                with contextlib.suppress(OSError):
                    send(conn, {"exit": code})
                os._exit(code)
        for fd in fds:
            os.close(fd)
        self.children.add(pid)
        self.served += 1
        return True

    def reap(self) -> None:
        """Forget the children that ended."""
        for pid in list(self.children):
            with contextlib.suppress(ChildProcessError):
                done, _ = os.waitpid(pid, os.WNOHANG)
                if done == 0:
                    continue
            self.children.discard(pid)


def serve(path: Path, idle: float) -> None:
    """Warm up, listen at ``path`` and answer until ``idle`` seconds pass with no request
    and no command running, a stop request comes, or ``path`` is removed."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    staging = path.with_suffix(f".{os.getpid()}.tmp")  # a daemon warming up: see client
    listener.bind(os.fspath(staging))
    listener.listen(16)
    try:
        warm_up()
    except BaseException:
        os.unlink(staging)
        raise
    gc.collect()
    gc.freeze()  # what the children inherit stays out of their collections
    os.replace(staging, path)  # commands see the socket only once it is warm
    mine = os.stat(path).st_ino
    daemon = Daemon(path, idle, listener)
    last = time.monotonic()
    try:
        while True:
            ready, _, _ = select.select([listener], [], [], 1.0)
            daemon.reap()
            if not path.exists() or os.stat(path).st_ino != mine:
                return  # removed, or another daemon took the path
            if ready:
                conn, _ = listener.accept()
                with conn:
                    try:
                        if not daemon.answer(conn):
                            return
                    except OSError:  # the command went away mid-request: serve the next
                        pass
                last = time.monotonic()
            elif not daemon.children and time.monotonic() - last > idle:
                return
    finally:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == mine:  # not a later daemon's socket at the same path
                os.unlink(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True, type=Path)
    parser.add_argument("--idle", type=float, default=1800.0)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(json.dumps({"pid": os.getpid(), "socket": str(args.socket)}), flush=True)
    serve(args.socket, args.idle)


if __name__ == "__main__":
    main()
