"""The harvest's fresh-process rows: ``vramplan measure ... --json`` for the published
setups a card can reproduce (GPUMemNet's CNNs at 224x224, fp32 Adam, batch 32/64/128) and
a few language models, each in its own process, written as ``rows/<name>.json`` for
``python -m benchmarks.accuracy.gpu_table``::

    >>> [row.name for row in DEVICE_ROWS][:2]
    ['vgg16-b32', 'resnet50-b32']
    >>> measure_command(DEVICE_ROWS[0])[-8:]
    ['measure', 'torchvision:vgg16', '-b', '32', '-o', 'adam', '--steps', '3']
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from benchmarks.gpu_harvest.child import ROOT, child_env


@dataclass(frozen=True)
class DeviceRow:
    """One measured run: its file name, model and ``vramplan measure`` arguments."""

    name: str
    model: str
    args: tuple[str, ...]


def _gpumemnet() -> list[DeviceRow]:
    models = ("vgg16", "resnet50", "mobilenet_v2")
    return [
        DeviceRow(f"{m}-b{b}", f"torchvision:{m}", ("-b", str(b), "-o", "adam"))
        for b in (32, 128, 64)
        for m in models
    ]


LANGUAGE = ("-b", "8", "--seq-len", "512", "-o", "adamw")
TINYLLAMA = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"


def row_of(name: str, model: str, args: str) -> DeviceRow:
    """A row from its measure arguments as one string."""
    return DeviceRow(name, model, tuple(args.split()))


AMP, CKPT = "--precision amp-bf16", "--checkpointing full"
RECIPES = (
    row_of("vgg16-b32-ampbf16", "torchvision:vgg16", f"-b 32 -o adam {AMP}"),
    row_of("resnet50-b64-ampbf16", "torchvision:resnet50", f"-b 64 -o adam {AMP}"),
    row_of("resnet50-b64-ckpt", "torchvision:resnet50", f"-b 64 -o adam {CKPT}"),
    row_of("mobilenet_v2-b128-ampbf16", "torchvision:mobilenet_v2", f"-b 128 -o adam {AMP}"),
    row_of("resnet18-b256-ampbf16", "torchvision:resnet18", f"-b 256 -o sgd {AMP}"),
    row_of("bert-base-b16-ampbf16", "hf:bert-base-uncased", f"-b 16 --seq-len 512 -o adamw {AMP}"),
    row_of("gpt2-b8-ckpt-ampbf16", "hf:gpt2", f"-b 8 --seq-len 512 -o adamw {AMP} {CKPT}"),
    row_of("gpt2-b4-s1024-sgd", "hf:gpt2", "-b 4 --seq-len 1024 -o sgd"),
    row_of(
        "tinyllama-lora-bf16", TINYLLAMA, "-b 8 --seq-len 512 -o adamw --precision bf16 --lora 16"
    ),
    row_of(
        "tinyllama-bf16-ckpt-b8-s1024",
        TINYLLAMA,
        f"-b 8 --seq-len 1024 -o adamw --precision bf16 {CKPT}",
    ),
)
"""Recipes beyond the published setups (amp-bf16, checkpointing, LoRA, SGD), first run on
the H200 on 2026-11-27; last, so the budget cuts them first."""
DEVICE_ROWS = (
    *_gpumemnet(),
    DeviceRow("bert-base-b8-s512", "hf:bert-base-uncased", LANGUAGE),
    DeviceRow("gpt2-b8-s512", "hf:gpt2", LANGUAGE),
    DeviceRow("tinyllama-fp32-b8-s512", TINYLLAMA, LANGUAGE),
    *RECIPES,
)


def measure_command(row: DeviceRow) -> list[str]:
    """The command line that measures ``row`` (three steps, JSON on stdout)."""
    return [sys.executable, "-m", "vramplan", "measure", row.model, *row.args, "--steps", "3"]


def measure_row(row: DeviceRow, folder: Path, timeout: float) -> dict:
    """Run one row in a fresh process; its JSON is written to ``folder/<name>.json``."""
    start = time.perf_counter()
    out: dict = {"name": row.name}
    try:
        done = subprocess.run(
            [*measure_command(row), "--json"],
            cwd=ROOT,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {**out, "error": f"timed out after {timeout:.0f} s"}
    out["seconds"] = round(time.perf_counter() - start, 1)
    try:
        result = json.loads(done.stdout)
    except json.JSONDecodeError:
        tail = (done.stderr or done.stdout).strip().splitlines()[-2:]
        return {**out, "error": f"exit code {done.returncode}: " + " | ".join(tail)}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{row.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    return {**out, "errors": result.get("errors", {})}


def measure_rows(
    folder: Path, jobs: int, budget_s: float, rows: tuple[DeviceRow, ...] = DEVICE_ROWS
) -> list[dict]:
    """Every row, ``jobs`` processes at a time (each reads its own process's memory); a
    row not started before ``budget_s`` has passed is recorded as skipped."""
    start = time.monotonic()

    def one(row: DeviceRow) -> dict:
        left = budget_s - (time.monotonic() - start)
        if left < 20:
            return {"name": row.name, "error": "skipped: the budget was spent"}
        return measure_row(row, folder, timeout=left)

    with ThreadPoolExecutor(max(1, jobs)) as threads:
        futures = [threads.submit(one, row) for row in rows]
        return [future.result() for future in futures]
