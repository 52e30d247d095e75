"""Whole-process time (and peak resident memory) of vramplan commands as a user types them.

    python -m benchmarks.speed.commands                    # every row, 3 runs each
    python -m benchmarks.speed.commands --only calc,llm    # rows whose name has a word
    python -m benchmarks.speed.commands --write            # also benchmarks/results/<date>-speed.md
    python -m benchmarks.speed.commands --before /tmp/old/src   # an older checkout beside it
    python -m benchmarks.speed.commands --only plan,max-batch   # the planner rows (minutes)
    python -m benchmarks.speed.commands --only plan --jobs 1    # ... one trace at a time
    python -m benchmarks.speed.commands --daemon           # with `vramplan daemon start` first

Each run is a fresh ``python -m vramplan ...`` (start-up, imports, model build, trace and
rendering included, output to a file); the table gives the best and the median of
``--repeat`` runs, the median CPU seconds (user + sys of the child: what to compare on a
shared machine) and the largest resident set (``ru_maxrss`` of that child). It prints
figures and never fails on time: the targets of issue 14 are printed beside them. With
``--before SRC``, each run alternates with one of the package under ``SRC`` (an older
checkout's ``src``), so both columns see the same machine load. The load column is the
one-minute load average after each row. The packages measured are byte-compiled first
(``compileall``), as an installed package is: with ``PYTHONDONTWRITEBYTECODE`` set, a
checkout's modules would otherwise be compiled from source in every run.

With ``--daemon``, a ``vramplan daemon`` is started first (in a folder of its own; the time
it took is printed) and the commands that trace go to it, as a user's do after ``vramplan
daemon start``: the wall seconds are the user's wait; the CPU and RSS columns are then the
command's own process only (the work runs in the daemon's child), not the work.
"""

from __future__ import annotations

import argparse
import compileall
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"

# Llama-3.1-405B's shape (no weights, no download): 126 layers of width 16384.
LLAMA_405B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "vocab_size": 128256,
    "hidden_size": 16384,
    "intermediate_size": 53248,
    "num_hidden_layers": 126,
    "num_attention_heads": 128,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
}

# (name, arguments after ``vramplan``, target seconds from issue 14 or None)
ROWS = [
    ("--help", ["--help"], 0.3),
    ("calc", ["calc", "--params", "20M", "--activations-per-sample", "1M", "-b", "32"], 0.3),
    ("llm llama-3-8b", ["llm", "hf:meta-llama-3-8b", "--seq-len", "4096"], 0.3),
    ("gpus", ["gpus"], 0.3),
    ("layers vgg16", ["layers", str(ROOT / "examples" / "vgg16.yaml")], 0.3),
    ("models hf", ["models", "hf"], 0.3),
    ("estimate resnet50 b32", ["estimate", "torchvision:resnet50", "-b", "32"], 3.0),
    (
        "estimate llama-3-8b s4096 bf16",
        ["estimate", "hf:meta-llama-3-8b", "--seq-len", "4096", "--precision", "bf16"],
        4.0,
    ),
    (
        "estimate llama-3-8b s4096 amp-bf16",
        ["estimate", "hf:meta-llama-3-8b", "--seq-len", "4096", "--precision", "amp-bf16"],
        4.0,
    ),
    (
        "estimate llama-3-70b s4096 bf16",
        ["estimate", "hf:meta-llama-3-70b", "--seq-len", "4096", "--precision", "bf16"],
        6.0,
    ),
    (
        "estimate llama-3.1-405b s4096 bf16",
        ["estimate", "hf:{405b}", "--seq-len", "4096", "--precision", "bf16"],
        10.0,
    ),
    ("max-batch resnet50 t4", ["max-batch", "torchvision:resnet50", "--gpu", "t4"], 10.0),
]


def _plan_row(model: str, target: float) -> tuple[str, list[str], float]:
    """``plan hf:MODEL`` at seq 4096, batch 8, on an A100-80GB (issue 14's planner target)."""
    args = ["plan", f"hf:{model}", "--seq-len", "4096", "--batch-size", "8"]
    return f"plan {model} s4096 b8 a100-80gb", [*args, "--gpu", "a100-80gb", "--json"], target


# Minutes each before issue 14's planner work: run only when named (``--only plan``) or
# with ``--slow``.
SLOW_ROWS = [
    _plan_row("meta-llama-3-8b", 30.0),
    _plan_row("meta-llama-3-70b", 60.0),
    (
        "max-batch llama-3-8b s4096 bf16 fused a100-80gb",
        [
            "max-batch",
            "hf:meta-llama-3-8b",
            "--seq-len",
            "4096",
            "--precision",
            "bf16",
            "--checkpointing",
            "full",
            "--optimizer-impl",
            "fused",
            "--gpu",
            "a100-80gb",
        ],
        None,
    ),
]


def run_once(args: list[str], src: str | None = None) -> tuple[float, int, int, float]:
    """Seconds, exit code, peak RSS (bytes) and CPU seconds (user + sys of the child) of
    one ``python -m vramplan ARGS`` (with ``src`` first on ``PYTHONPATH`` when given)."""
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    with tempfile.TemporaryFile() as out:
        start = time.perf_counter()
        child = subprocess.Popen(
            [sys.executable, "-m", "vramplan", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
        _, status, usage = os.wait4(child.pid, 0)
        elapsed = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode not in (0, 3):
            out.seek(0)
            raise SystemExit(f"vramplan {' '.join(args)} failed:\n{out.read().decode()[-2000:]}")
    return elapsed, child.returncode, usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime


def byte_compile(src: str | None) -> None:
    """Write the ``.pyc`` files of the vramplan that ``src`` (or the installed one) imports."""
    where = Path(_where(src).split(" (")[0]).parent
    compileall.compile_dir(where, quiet=1)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _where(src: str | None) -> str:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    where = subprocess.run(
        [sys.executable, "-c", "import vramplan; print(vramplan.__file__)"],
        capture_output=True,
        text=True,
        env=env,
    ).stdout.strip()
    commit = subprocess.run(
        ["git", "-C", str(Path(where).parent), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return f"{where} ({commit or 'not a git checkout'})"


def machine(before: str | None) -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    versions = []
    for name in ("torch", "torchvision", "transformers", "timm", "typer", "rich"):
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return (
        f"{cores} cores ({cpu_model()}), {platform.system()} {platform.release()}; "
        f"Python {platform.python_version()}, {', '.join(versions)}; "
        f"vramplan {_where(None)}"
        + (f", before: {_where(before)}" if before else "")
        + f"; load average before the run {os.getloadavg()[0]:.2f}"
    )


def start_daemon(folder: Path) -> str:
    """Start a ``vramplan daemon`` listening in ``folder`` for the runs that follow (they
    inherit ``VRAMPLAN_DAEMON_DIR``); what it printed."""
    os.environ["VRAMPLAN_DAEMON_DIR"] = str(folder)
    started = subprocess.run(
        [sys.executable, "-m", "vramplan", "daemon", "start"],
        capture_output=True,
        text=True,
        check=True,
    )
    return started.stdout.strip()


def _seconds(runs: list[tuple[float, int, int, float]]) -> str:
    """Best and median wall seconds, and median CPU seconds (less sensitive to load)."""
    seconds = [r[0] for r in runs]
    cpu = statistics.median(r[3] for r in runs)
    return f"{min(seconds):.2f} | {statistics.median(seconds):.2f} | {cpu:.2f}"


def _rss(runs: list[tuple[float, int, int, float]]) -> str:
    return f"{max(r[2] for r in runs) / 2**20:.0f}"


def _with_jobs(row: tuple, jobs: int) -> tuple:
    """A planner row (``plan``, ``max-batch``) run with ``--jobs N``; other rows as they are."""
    name, args, target = row
    if args[0] not in ("plan", "max-batch"):
        return row
    return f"{name} --jobs {jobs}", [*args, "--jobs", str(jobs)], target


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated words of row names")
    parser.add_argument("--write", action="store_true", help="write benchmarks/results/")
    parser.add_argument("--title", default="", help="a line under the table's heading")
    parser.add_argument("--before", default=None, help="an older checkout's src, run alternately")
    parser.add_argument("--slow", action="store_true", help="also the plan rows (minutes)")
    parser.add_argument(
        "--jobs", type=int, default=None, help="--jobs N for plan and max-batch (their default)"
    )
    parser.add_argument(
        "--daemon", action="store_true", help="start `vramplan daemon` first (warm commands)"
    )
    options = parser.parse_args(argv)
    if options.daemon and options.before:
        parser.error("--daemon measures this checkout only: leave out --before")
    words = [w for w in options.only.split(",") if w]
    rows = [row for row in ROWS if not words or any(w in row[0] for w in words)]
    rows += [
        row for row in SLOW_ROWS if (options.slow and not words) or any(w in row[0] for w in words)
    ]
    if options.jobs is not None:
        rows = [_with_jobs(row, options.jobs) for row in rows]

    for src in {None, options.before}:
        byte_compile(src)
    lines = [
        f"## Whole commands (python -m benchmarks.speed.commands, {options.repeat} runs each)",
        "",
        *([options.title, ""] if options.title else []),
        machine(options.before),
        "",
    ]
    if options.before:
        lines += [
            "| command | best s | median s | CPU s | before: best s | before: median s "
            "| before: CPU s | target s | peak RSS MiB | before: RSS MiB | exit | load |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
    else:
        lines += [
            "| command | best s | median s | CPU s | target s | peak RSS MiB | exit | load |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
    with tempfile.TemporaryDirectory() as folder:
        if options.daemon:
            lines.insert(-2, start_daemon(Path(folder) / "daemon") + "\n")
        print("\n".join(lines), flush=True)
        config = Path(folder) / "llama-3.1-405b" / "config.json"
        config.parent.mkdir()
        config.write_text(json.dumps(LLAMA_405B, indent=2))
        for name, args, target in rows:
            args = [a.replace("{405b}", str(config)) for a in args]
            runs, old = [], []
            for _ in range(options.repeat):
                if options.before:
                    old.append(run_once(args, options.before))
                runs.append(run_once(args))
            line = f"| `{name}` | {_seconds(runs)} | "
            if old:
                line += f"{_seconds(old)} | "
            line += f"{target if target is not None else '-'} | {_rss(runs)} | "
            if old:
                line += f"{_rss(old)} | "
            line += f"{runs[-1][1]} | {os.getloadavg()[0]:.1f} |"
            lines.append(line)
            print(line, flush=True)
        if options.daemon:
            subprocess.run([sys.executable, "-m", "vramplan", "daemon", "stop"], check=True)
    text = "\n".join(lines) + "\n"
    if options.write:
        path = RESULTS / f"{datetime.date.today().isoformat()}-speed.md"
        heading = f"# Speed, {datetime.date.today().isoformat()}\n\n"
        path.write_text((path.read_text() + "\n" if path.exists() else heading) + text)
        print(f"wrote {path}")
    return text


if __name__ == "__main__":
    main()
