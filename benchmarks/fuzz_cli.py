"""Fuzz the command line: random flag values and config fields, and the properties every
answer must have. ``python benchmarks/fuzz_cli.py [N] [--seed S]`` runs N calls (default
10,000) and prints how many ended in a traceback, in an exit 0 for an input the bad-input
matrix calls invalid, or broke an invariant; ``tests/test_fuzz_cli.py`` runs the same
checks, bounded, in CI.

A call ends in one of three ways: an answer (exit 0, or 3 for OOM) whose figures agree
with each other, or a refusal (exit 2) in one line. Anything else — a traceback, another
exit code, an answer to an input the matrix calls invalid — is a failure::

    outcome = run_cli_captured(["calc", "--params", "0.5"])
    problems(outcome)   # [] when the call behaved
"""

from __future__ import annotations

import contextlib
import io
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TINY_GPT2 = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "vocab_size": 512,
    "n_positions": 64,
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 2,
}
GPU_NAMES = ("t4", "a100", "h100", "A100-80GB", "rtx 4090", "mi300x", "", " ", "a1000", "gpu")
SIZES = ("24GiB", "80GB", "512MiB", "24", "0", "-1GiB", "1e9TiB", "0.5GiB", "16G", "", "lots")
PRECISIONS = ("fp32", "fp16", "bf16", "amp-fp16", "amp-bf16", "fp8", "")
OPTIMIZERS = ("sgd", "momentum", "adam", "adamw", "adafactor", "lion", "adam8bit", "none", "x")
NUMBERS = ("1", "2", "4", "0", "-1", "1.5", "abc", "", "1e3", "64", "3x")
SHAPES = ("3x32x32", "16", "3x224x224x", "x", "0x3", "8", "3,32,32", "", "-3x4", "3xx2")
CHECKPOINTING = ("none", "full", "0", "1", "2", "3", "1000", "-1", "half")


@dataclass
class Outcome:
    """One fuzzed call: the arguments and what came back."""

    args: list[str]
    code: Any
    out: str
    err: str
    invalid: bool = False
    """The generator made an input the bad-input matrix calls invalid (must not exit 0)."""
    notes: list[str] = field(default_factory=list)


def run_cli_captured(args: list[str]) -> Outcome:
    """Run ``vramplan ARGS`` in-process and capture what it printed."""
    from vramplan.cli import main

    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(args)
    except SystemExit as exc:
        code = exc.code
    except BaseException as exc:  # noqa: BLE001 - a crash is exactly what the fuzz looks for
        code = f"raised {type(exc).__name__}: {exc}"
        err.write("Traceback (most recent call last):\n  (escaped main)\n")
    return Outcome(args, code, out.getvalue(), err.getvalue())


def problems(outcome: Outcome) -> list[str]:
    """What is wrong with a call's result (empty when nothing is)."""
    found = []
    code, out, err = outcome.code, outcome.out, outcome.err
    if "Traceback" in out + err:
        found.append("traceback")
    if code not in (0, 2, 3):
        found.append(f"exit code {code!r}")
    if code == 2:
        lines = err.strip().splitlines()
        if len(lines) != 1 or not lines[0].startswith("vramplan: error: "):
            found.append(f"refusal is not one line: {err!r}")
        if "--json" in outcome.args and out:
            found.append("stdout under --json on a refusal")
    if code == 0 and outcome.invalid:
        found.append("exit 0 for an invalid input")
    if code in (0, 3) and "--json" in outcome.args and out.strip():
        try:
            data = json.loads(out)
        except json.JSONDecodeError:
            found.append("stdout is not JSON under --json")
        else:
            found += invariant_problems(data, code)
    return found


def invariant_problems(data: dict, code: int) -> list[str]:
    """Cross-figure invariants of a ``vramplan.estimate/1`` object (or one holding it)."""
    found = []
    estimate = data.get("estimate", data)
    peak = estimate.get("peak")
    if not isinstance(peak, dict):
        return found
    allocated = peak["allocated_bytes"]
    reserved = peak.get("reserved_bytes")
    total = peak.get("device_total_bytes")
    if reserved and total:
        if not allocated <= reserved <= total:
            found.append(f"allocated {allocated} <= reserved {reserved} <= total {total} fails")
        low, high = peak.get("device_total_range_bytes") or (total, total)
        if not low <= total <= high:
            found.append(f"device total {total} outside its range [{low}, {high}]")
    components = estimate.get("components", {})
    if components and sum(components.values()) != allocated:
        found.append(f"components sum {sum(components.values())} != allocated {allocated}")
    verdict = estimate.get("verdict")
    if verdict:
        usable = int(verdict["capacity_bytes"] * (1.0 - verdict["headroom"]))
        if verdict["usable_bytes"] != usable:
            found.append("usable bytes do not follow from the capacity and the headroom")
        status, compared = verdict["status"], verdict["compared_bytes"]
        if status == "fits" and compared > usable:
            found.append("fits, yet the compared figure passes the usable line")
        if status == "tight" and compared <= usable:
            found.append("tight, yet the compared figure is under the usable line")
        if reserved and compared < reserved:
            found.append("the verdict compares less than the reserved bytes")
        if (status == "oom") != (code == 3) and "estimate" not in data:
            found.append(f"status {status} with exit code {code}")
    return found


# -- the generator ----------------------------------------------------------------------------


def _pick(rng: random.Random, values: tuple[str, ...], valid: int = 0) -> str:
    """A value from ``values``; with ``valid``, one of the first ``valid`` (the good ones)
    three times in four."""
    if valid and rng.random() < 0.75:
        return rng.choice(values[:valid])
    return rng.choice(values)


def _config_value(rng: random.Random, good: Any) -> Any:
    return rng.choice(
        [good, good, good, 0, -1, 1, 3, 7, 2**40, "32", "big", None, 1.5, True, [], {}]
    )


def fuzz_config(rng: random.Random) -> tuple[dict, bool]:
    """The tiny GPT-2 config with some fields replaced: (config, surely invalid)."""
    config = dict(TINY_GPT2)
    changed = rng.choice([0, 0, 1, 1, 2, 3])
    for key in rng.sample(sorted(config), changed):
        config[key] = _config_value(rng, config[key])
    if rng.random() < 0.1:
        config = {"model_type": rng.choice(["gpt2", "llama"])}
    invalid = _config_invalid(config)
    return config, invalid


def _config_invalid(config: dict) -> bool:
    def positive_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and 0 < v < 2**31

    sizes = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
    if any(k not in config for k in ("n_embd", "n_layer")):
        return True
    if not all(positive_int(config.get(k)) for k in sizes if k in config):
        return True
    if config.get("model_type") != "gpt2" or config.get("n_layer", 0) > 1000:
        return True
    archs = config.get("architectures")
    if archs is not None and not (
        isinstance(archs, list) and all(isinstance(a, str) for a in archs)
    ):
        return True
    return config["n_embd"] % config.get("n_head", 12) != 0


COMMANDS = ("estimate", "estimate", "estimate", "calc", "llm", "max-batch")


def fuzz_call(
    rng: random.Random, folder: Path, commands: tuple[str, ...] = COMMANDS
) -> tuple[list[str], bool]:
    """Random arguments for one command: (args, surely invalid). ``folder`` holds the
    fuzzed config files the call may name; ``commands`` those to draw from (``max-batch``
    traces a handful of times per call)."""
    command = rng.choice(commands)
    invalid = False
    if command == "calc":
        params = _pick(
            rng, ("20M", "1.3B", "7000", "2e7", "0.5", "0", "-5", "abc", "1e400"), valid=4
        )
        invalid |= params in ("0.5", "0", "-5", "abc", "1e400")
        args = ["calc", "--params", params]
        if rng.random() < 0.5:
            apps = _pick(rng, ("1M", "0", "-1", "x", "3"))
            invalid |= apps in ("-1", "x")
            args += ["--activations-per-sample", apps]
        if rng.random() < 0.3:
            shape = _pick(rng, SHAPES, valid=2)
            invalid |= shape in ("3x224x224x", "x", "0x3", "-3x4", "3xx2", "")
            args += ["--input-shape", shape]
        return [*args, *_recipe_flags(rng, text=False), "--json"], invalid
    config, bad_config = fuzz_config(rng)
    path = folder / f"config-{rng.randrange(10**9)}.json"
    path.write_text(json.dumps(config))
    model = f"hf:{path}"
    invalid |= bad_config
    if command == "llm":
        args = ["llm", model, *_recipe_flags(rng, text=True)]
        if rng.random() < 0.3:
            rank = _pick(rng, ("0", "8", "-4"))
            invalid |= rank == "-4"
            args += ["--lora-rank", rank]
        return [*args, "--json"], invalid
    flags = _recipe_flags(rng, text=True)
    card: list[str] = []
    if command == "max-batch" or rng.random() < 0.5:
        if rng.random() < 0.6:
            name = _pick(rng, GPU_NAMES, valid=6)
            invalid |= name in ("", " ", "a1000", "gpu")
            card = ["--gpu", name]
        else:
            size = _pick(rng, SIZES, valid=3)
            invalid |= size in ("24", "0", "-1GiB", "1e9TiB", "", "lots")
            card = ["--gpu-memory", size]
    if command == "max-batch":
        invalid |= not card
        if rng.random() < 0.3:
            flags += ["--search", _pick(rng, ("batch-size", "seq-len", "tokens"))]
            invalid |= flags[-1] == "tokens"
    if rng.random() < 0.2:
        headroom = _pick(rng, ("0.1", "0", "0.99", "1", "-0.1", "nan", "x"))
        invalid |= headroom in ("1", "-0.1", "nan", "x")
        flags += ["--headroom", headroom]
    invalid |= _flags_invalid(flags)
    return [command, model, *card, *flags, "--json"], invalid


def _recipe_flags(rng: random.Random, text: bool) -> list[str]:
    flags = []
    if rng.random() < 0.6:
        flags += ["--batch-size", _pick(rng, NUMBERS, valid=3)]
    if text and rng.random() < 0.4:
        flags += ["--seq-len", _pick(rng, ("16", "32", "64", "65", "0", "-2", "x"), valid=3)]
    if rng.random() < 0.4:
        flags += ["--precision", _pick(rng, PRECISIONS, valid=5)]
    if rng.random() < 0.4:
        flags += ["--optimizer", _pick(rng, OPTIMIZERS, valid=8)]
    if rng.random() < 0.2:
        flags += ["--mode", _pick(rng, ("train", "infer", "eval"), valid=2)]
    if text and rng.random() < 0.2:
        flags += ["--checkpointing", _pick(rng, CHECKPOINTING, valid=4)]
    return flags


def _flags_invalid(flags: list[str]) -> bool:
    values = dict(zip(flags[::2], flags[1::2], strict=False))
    bad = {
        "--batch-size": lambda v: not v.isdigit() or int(v) <= 0,
        "--seq-len": lambda v: not v.isdigit() or not 0 < int(v) <= 64,
        "--precision": lambda v: v not in PRECISIONS[:5],
        "--optimizer": lambda v: v not in OPTIMIZERS[:8],
        "--mode": lambda v: v not in ("train", "infer"),
        "--checkpointing": lambda v: v in ("-1", "half", "3", "1000"),
    }
    if any(flag in values and test(values[flag]) for flag, test in bad.items()):
        return True
    infer = values.get("--mode") == "infer"
    return infer and values.get("--checkpointing", "none") not in ("none", "0")


def main(argv: list[str] | None = None) -> int:
    import argparse
    import collections
    import tempfile
    import time

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("calls", nargs="?", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=5, help="examples to print per problem")
    options = parser.parse_args(argv)
    rng = random.Random(options.seed)
    counts: collections.Counter = collections.Counter()
    examples: dict[str, list[str]] = collections.defaultdict(list)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        for index in range(options.calls):
            args, invalid = fuzz_call(rng, Path(folder))
            outcome = run_cli_captured(args)
            outcome.invalid = invalid
            counts[f"exit {outcome.code}" if isinstance(outcome.code, int) else "crash"] += 1
            counts["invalid inputs"] += invalid
            for problem in problems(outcome):
                kind = problem.split(":")[0][:60]
                counts[f"problem: {kind}"] += 1
                if len(examples[kind]) < options.show:
                    examples[kind].append(f"{' '.join(args)}\n      -> {outcome.err.strip()[:300]}")
            for path in Path(folder).glob("config-*.json"):
                path.unlink()
            if (index + 1) % 1000 == 0:
                print(f"{index + 1} calls, {time.perf_counter() - start:.0f} s", flush=True)
    print(
        f"{options.calls} fuzzed calls in {time.perf_counter() - start:.0f} s (seed {options.seed})"
    )
    for key, value in sorted(counts.items()):
        print(f"  {key}: {value}")
    tracebacks = counts["problem: traceback"]
    wrong_zero = counts["problem: exit 0 for an invalid input"]
    print(f"tracebacks: {tracebacks}; exit-0 answers to invalid inputs: {wrong_zero}")
    for kind, shown in examples.items():
        print(f"-- {kind}")
        for line in shown:
            print(f"   {line}")
    return 1 if any(k.startswith("problem") for k in counts) else 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
