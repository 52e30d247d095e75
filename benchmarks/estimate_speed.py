"""Wall time of one ``vramplan estimate`` per model, Python start-up included.

    python benchmarks/estimate_speed.py            # the default list
    python benchmarks/estimate_speed.py --repeat 3 torchvision:resnet50

Each estimate runs as a fresh process (what a user waits for at the shell); the table
prints the best and median of ``--repeat`` runs and the predicted peak.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

DEFAULT_RUNS = [
    ["torchvision:resnet50", "--batch-size", "32", "--precision", "fp32", "--optimizer", "sgd"],
    ["torchvision:resnet18", "--batch-size", "64"],
    ["torchvision:vit_b_16", "--batch-size", "32", "--precision", "amp-bf16"],
    ["hf:gpt2", "--seq-len", "512", "--batch-size", "8"],
    ["hf:bert-base-uncased", "--seq-len", "512", "--batch-size", "8"],
    ["hf:meta-llama-3-8b", "--seq-len", "4096", "--batch-size", "1", "--precision", "bf16"],
]


def time_once(args: list[str]) -> tuple[float, int]:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "vramplan", "estimate", *args, "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    elapsed = time.perf_counter() - start
    return elapsed, json.loads(done.stdout)["peak"]["allocated_bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="*", help="model spec (default: a fixed list)")
    parser.add_argument("--repeat", type=int, default=3)
    options = parser.parse_args()
    runs = [[m] for m in options.model] or DEFAULT_RUNS
    print(f"{'workload':<70} {'best s':>7} {'median s':>9} {'peak GiB':>9}")
    for args in runs:
        times, peak = [], 0
        for _ in range(options.repeat):
            elapsed, peak = time_once(args)
            times.append(elapsed)
        print(
            f"{' '.join(args):<70} {min(times):7.2f} {statistics.median(times):9.2f} "
            f"{peak / 2**30:9.2f}"
        )


if __name__ == "__main__":
    main()
