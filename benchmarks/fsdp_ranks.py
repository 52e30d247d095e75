"""Per-rank memory under FSDP2, traced through ``fully_shard`` on a fake process group,
beside one GPU and beside the layout formula, for a few models and world sizes.

    python benchmarks/fsdp_ranks.py [--quick]

Prints allocated / reserved / device total per rank (MiB), the model states a rank holds,
and the formula's allocated figure with its ratio to the trace.
"""

from __future__ import annotations

import argparse
import time

from vramplan.device.options import device_options
from vramplan.distributed.facts import facts_of
from vramplan.distributed.fsdp import Fsdp2
from vramplan.distributed.layout import ParallelLayout, per_rank
from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe
from vramplan.sources import resolve

MiB = 2**20
WORKLOADS = (
    ("hf:gpt2", Recipe(batch_size=8, seq_len=1024, precision="amp-bf16"), "a100-40gb", (8,)),
    (
        "hf:tinyllama-1.1b",
        Recipe(batch_size=4, seq_len=2048, precision="amp-bf16", checkpointing="full"),
        "a100-80gb",
        (2, 8),
    ),
    (
        "hf:meta-llama-3-8b",
        Recipe(batch_size=1, seq_len=4096, precision="amp-bf16", checkpointing="full"),
        "h100",
        (8, 64),
    ),
)


def _row(label: str, est, seconds: float, formula=None) -> str:
    states = sum(est.components[k] for k in ("parameters", "gradients", "optimizer_state"))
    peak = est.peak
    sizes = (peak.allocated_bytes, peak.reserved_bytes, peak.device_total_bytes, states)
    cells = [label, *(f"{n / MiB:,.0f}" for n in sizes), peak.phase, f"{seconds:.1f}"]
    if formula is not None:
        ratio = formula.peak.allocated_bytes / est.peak.allocated_bytes
        cells.append(f"{formula.peak.allocated_bytes / MiB:,.0f} (x{ratio:.2f})")
    else:
        cells.append("")
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="GPT-2 only")
    args = parser.parse_args()
    print(
        "| model, layout | allocated | reserved | device total | model states | peak phase "
        "| seconds | formula allocated (/ trace) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |")
    for spec, recipe, gpu, worlds in WORKLOADS[:1] if args.quick else WORKLOADS:
        start = time.perf_counter()
        single = estimate_built(resolve(spec, recipe), recipe, "cuda", device_options(gpu=gpu))
        print(_row(f"{spec} one {gpu}", single, time.perf_counter() - start))
        facts = facts_of(resolve(spec, recipe))
        for world in worlds:
            start = time.perf_counter()
            device = device_options(gpu=gpu, data_parallel=world)
            rank = estimate_built(resolve(spec, recipe), recipe, "cuda", device, Fsdp2(world))
            formula = per_rank(single, ParallelLayout(shard="fsdp", data_parallel=world), facts)
            print(_row(f"{spec} fsdp {world}", rank, time.perf_counter() - start, formula))


if __name__ == "__main__":
    main()
