"""How many traces ``vramplan max-batch`` needs, beside a doubling-and-bisection finder
(what accelerate's find_executable_batch_size and Lightning's BatchSizeFinder do, one
possibly-OOM run per trial).

    python benchmarks/max_batch_traces.py
"""

from __future__ import annotations

import time

from vramplan.device.options import device_options
from vramplan.planner.bench import Workbench
from vramplan.planner.search import largest_fitting
from vramplan.recipe import Recipe

CASES = [
    ("torchvision:resnet18", "t4", Recipe(batch_size=1, optimizer="sgd")),
    ("torchvision:resnet50", "a100-40gb", Recipe(batch_size=1, precision="amp-bf16")),
    ("torchvision:vit_b_16", "l4", Recipe(batch_size=1, precision="amp-bf16")),
    ("hf:gpt2", "a10g", Recipe(batch_size=1, seq_len=1024, precision="amp-bf16")),
    (
        "hf:tinyllama-1.1b",
        "h100",
        Recipe(batch_size=1, seq_len=2048, precision="amp-bf16", checkpointing="full"),
    ),
]


def main() -> None:
    print("| model | gpu | max batch | traces | bisection trials | seconds |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for model, gpu, recipe in CASES:
        start = time.perf_counter()
        result = largest_fitting(Workbench(model, device_options(gpu=gpu)), recipe)
        print(
            f"| {model} | {gpu} | {result.value} | {result.traces} | "
            f"{result.bisection_traces} | {time.perf_counter() - start:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
