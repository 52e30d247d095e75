"""How the device replay's reserved peak moves with the cuDNN workspace sizes (prints only):
the central replay again with every workspace of one size scaled by each factor, and
with new segments placed below the earlier ones (the driver's choice of addresses)::

    PYTHONPATH=src python benchmarks/workspace_sensitivity.py torchvision:vgg16 -b 64 \\
        --input-shape 3x224x224 -o adam --gpu h200 --stack torch2.11-cu13.0

A peak that jumps by whole segments under a 1% change comes from which cached segment
each workspace fits; measured sizes at the batch (a harvest that ran it) settle it, an
interpolated table does not.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import replace

from vramplan.device.allocator import AllocatorConfig, Request, replay
from vramplan.device.options import device_options
from vramplan.device.replay import WORKSPACE, device_trace, requests_of
from vramplan.pipeline import trace_and_estimate
from vramplan.recipe import Recipe
from vramplan.sources import resolve

MIB = 2**20
FACTORS = (0.99, 1.01)


def scaled_peaks(
    requests: list[Request], groups: dict[int, set[int]], factors: tuple[float, ...]
) -> list[tuple[int, float, int]]:
    """(workspace bytes, factor, reserved peak) with the requests of one size group scaled.

    >>> req = [Request(0, 30 * MIB, True), Request(0, 30 * MIB, False)]
    >>> [(f, p // MIB) for _, f, p in scaled_peaks(req, {30 * MIB: {0}}, (0.5, 1.0))]
    [(0.5, 16), (1.0, 30)]
    """
    peaks = []
    for size, keys in sorted(groups.items()):
        for factor in factors:
            scaled = [
                replace(r, size=int(r.size * factor)) if r.key in keys else r for r in requests
            ]
            peaks.append((size, factor, replay(scaled, AllocatorConfig()).stats.peak_reserved))
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("-b", "--batch-size", type=int, default=1)
    parser.add_argument("--input-shape")
    parser.add_argument("-p", "--precision", default="fp32")
    parser.add_argument("-o", "--optimizer", default="adamw")
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--stack")
    parser.add_argument("--cudnn-benchmark", action="store_true")
    parser.add_argument("--factors", default=",".join(str(f) for f in FACTORS))
    args = parser.parse_args()
    shape = tuple(int(n) for n in args.input_shape.split("x")) if args.input_shape else None
    recipe = Recipe(
        batch_size=args.batch_size,
        input_shape=shape,
        precision=args.precision,
        optimizer=args.optimizer,
    )
    options = device_options(gpu=args.gpu, stack=args.stack, cudnn_benchmark=args.cudnn_benchmark)
    _, trace = trace_and_estimate(resolve(args.model, recipe), recipe, "cuda", options)
    on_device = device_trace(
        trace, options.card, options.cudnn_benchmark, "central", options.measured
    )
    requests = requests_of(on_device)
    groups: dict[int, set[int]] = defaultdict(set)
    for a in on_device.trace.allocations:
        if a.op == WORKSPACE:
            groups[a.nbytes].add(a.id)
    central = replay(requests, AllocatorConfig()).stats.peak_reserved
    below = replay(requests, AllocatorConfig(), new_segments_below=True).stats.peak_reserved
    print(f"central replay {central / MIB:.0f} MiB; new segments below {below / MIB:.0f} MiB")
    print("workspace MiB, calls, factor, reserved peak MiB")
    factors = tuple(float(f) for f in args.factors.split(","))
    for size, factor, peak in scaled_peaks(requests, groups, factors):
        print(f"  {size / MIB:10.2f} {len(groups[size]):3d} {factor:6.3f} {peak / MIB:8.0f}")


if __name__ == "__main__":
    main()
