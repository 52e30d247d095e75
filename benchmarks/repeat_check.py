"""Full trace vs repeated blocks at real sizes: both figures and both times (prints only).

PYTHONPATH=src python benchmarks/repeat_check.py [--only llama]
"""

from __future__ import annotations

import argparse
import time

from vramplan.device.options import device_options
from vramplan.pipeline import trace_and_estimate
from vramplan.recipe import Recipe
from vramplan.sources import resolve

CASES = [
    ("hf:gpt2", dict(batch_size=8, seq_len=1024)),
    ("hf:bert-base-uncased", dict(batch_size=32, seq_len=512)),
    ("hf:vit-base-patch16-224", dict(batch_size=64)),
    ("hf:meta-llama-3-8b", dict(batch_size=1, seq_len=4096, precision="bf16")),
    ("hf:meta-llama-3-8b", dict(batch_size=1, seq_len=4096, precision="amp-bf16")),
    (
        "hf:meta-llama-3-8b",
        dict(batch_size=1, seq_len=4096, precision="bf16", checkpointing="full"),
    ),
    (
        "hf:meta-llama-3-8b",
        dict(batch_size=1, seq_len=4096, precision="amp-bf16", checkpointing="full"),
    ),
]


def run(spec: str, recipe: Recipe, repeat: bool):
    built = resolve(spec, recipe)
    built.repeat_blocks = repeat
    start = time.perf_counter()
    est, _ = trace_and_estimate(built, recipe, "cuda", device_options(gpu="h100"))
    return est, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    print(f"{'model':28} {'recipe':40} {'alloc full/rep (MiB)':>22} {'reserved':>20} time s")
    for spec, knobs in CASES:
        if args.only not in spec:
            continue
        recipe = Recipe(**knobs)
        full, t_full = run(spec, recipe, False)
        rep, t_rep = run(spec, recipe, True)
        used = any(n.startswith("repeated blocks") for n in rep.notes)
        mib = 2**20
        print(
            f"{spec:28} {str(knobs):40} "
            f"{full.peak.allocated_bytes / mib:10.1f}/{rep.peak.allocated_bytes / mib:<10.1f}"
            f"{full.peak.reserved_bytes / mib:10.1f}/{rep.peak.reserved_bytes / mib:<10.1f}"
            f"{t_full:6.1f}/{t_rep:<6.1f} {'repeated' if used else 'fell back'}"
        )


if __name__ == "__main__":
    main()
