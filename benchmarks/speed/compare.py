"""Time per estimate, vramplan beside PyTorch's MemTracker under FakeTensorMode, on the same
workloads in the same process, with both tools' allocated peaks.

    python -m benchmarks.speed.compare
    python -m benchmarks.speed.compare --only resnet

MemTracker (``torch.distributed._tools.mem_tracker``) counts live tensor bytes of a
traced step; vramplan does that and also replays the CUDA caching allocator and adds the
runtime. Both run two training iterations of the same model and batch, each from an empty
FakeTensor dispatch cache, alternately ``--repeat`` times; the table gives each tool's best.
What the imports and warm-up runs left alive is frozen out of the garbage collector's
passes first (``gc.freeze``, as vramplan's command line does): otherwise a full collection
over torch's and the model libraries' objects (about a quarter of a second on a 2-core
machine) lands in whichever tool's timing happens to trigger it.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe
from vramplan.sources import resolve
from vramplan.trace.materialize import materialize, unique_parameters

WORKLOADS = [
    ("resnet50 b32", "torchvision:resnet50", Recipe(batch_size=32, optimizer="adamw")),
    ("resnet18 b64", "torchvision:resnet18", Recipe(batch_size=64, optimizer="sgd")),
    ("vit_b_16 b16", "torchvision:vit_b_16", Recipe(batch_size=16, optimizer="adamw")),
    ("gpt2 b8 s512", "hf:gpt2", Recipe(batch_size=8, seq_len=512, optimizer="adamw")),
    ("bert-base b8 s512", "hf:bert-base-uncased", Recipe(batch_size=8, seq_len=512)),
]


def memtracker_peak(spec: str, recipe: Recipe) -> tuple[float, int]:
    """Seconds and peak bytes of MemTracker on the same step (model built on meta, then
    materialised as fake tensors, as vramplan does)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    built = resolve(spec, recipe)
    start = time.perf_counter()
    with FakeTensorMode():
        materialize(built.model)
        params = unique_parameters(built.model)
        optimizer = (
            torch.optim.AdamW(params, foreach=True)
            if recipe.optimizer == "adamw"
            else torch.optim.SGD(params, lr=0.1)
        )
        batch = built.make_batch(recipe.batch_size, torch.float32)
        tracker = MemTracker()
        tracker.track_external(built.model, optimizer)
        with tracker:
            for _ in range(2):
                built.run(built.model, batch, True).backward()
                optimizer.step()
                optimizer.zero_grad()
                tracker.reset_mod_stats()  # MemTracker refuses a second call otherwise
        peak = tracker.get_tracker_snapshot("peak")
    elapsed = time.perf_counter() - start
    total = sum(stats.get("Total", 0) for stats in peak.values())
    return elapsed, int(total)


def vramplan_peak(spec: str, recipe: Recipe) -> tuple[float, int, int]:
    """Seconds, tensor-allocated and reserved peaks of vramplan's estimate of the step, as
    ``vramplan.Session`` makes it (a run of 16 or more identical blocks traced once; these
    workloads have 12 at most, so every block is traced)."""
    start = time.perf_counter()
    built = resolve(spec, recipe)
    built.repeat_blocks = True
    estimate = estimate_built(built, recipe, "cuda")
    return (
        time.perf_counter() - start,
        estimate.details["tensor_allocated_bytes"],
        estimate.peak.reserved_bytes,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only")
    parser.add_argument("--repeat", type=int, default=3)
    options = parser.parse_args()
    # first-call costs (imports, caches: torchvision's and transformers') are paid here,
    # outside the timings
    for spec, warm in (
        ("torchvision:resnet18", Recipe(batch_size=1, optimizer="sgd")),
        ("hf:gpt2", Recipe(batch_size=1, seq_len=16, optimizer="sgd")),
    ):
        vramplan_peak(spec, warm)
        memtracker_peak(spec, warm)
    gc.collect()
    gc.freeze()
    print(
        "| workload | vramplan s | MemTracker s | MemTracker / vramplan | "
        "vramplan allocated MiB | MemTracker MiB | vramplan reserved MiB |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, spec, recipe in WORKLOADS:
        if options.only and options.only not in name:
            continue
        ours, theirs = [], []
        for _ in range(options.repeat):
            # each tool starts from an empty FakeTensor dispatch cache: the second would
            # otherwise find the first's entries for the same shapes
            FakeTensorMode.cache_clear()
            seconds, allocated, reserved = vramplan_peak(spec, recipe)
            ours.append(seconds)
            FakeTensorMode.cache_clear()
            seconds, tracked = memtracker_peak(spec, recipe)
            theirs.append(seconds)
        ours, theirs = min(ours), min(theirs)
        print(
            f"| {name} | {ours:.2f} | {theirs:.2f} | {theirs / ours:.1f}x | "
            f"{allocated / 2**20:.0f} | {tracked / 2**20:.0f} | {reserved / 2**20:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
