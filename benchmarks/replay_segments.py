"""The device replay's segments, for comparing with a real snapshot (prints only): every
request that made the allocator reserve a new segment, and the segment list (blocks in
address order, A allocated, f free) when the reserved peak was reached::

    PYTHONPATH=src python benchmarks/replay_segments.py torchvision:vgg16 -b 128 \\
        --input-shape 3x224x224 -o adam --gpu h200 --stack torch2.11-cu13.0

The replay is the central one of ``vramplan estimate`` (its workspaces and order); cuDNN's
fallback engines, tried only near the card's capacity, are not.
"""

from __future__ import annotations

import argparse

from vramplan.device.allocator import AllocatorConfig, CachingAllocator, Request
from vramplan.device.options import device_options
from vramplan.device.replay import device_trace, requests_of
from vramplan.pipeline import trace_and_estimate
from vramplan.recipe import Recipe
from vramplan.sources import resolve

MIB = 2**20


def segment_list(sim: CachingAllocator) -> list[tuple[int, list[tuple[int, bool]]]]:
    """(segment bytes, [(block bytes, allocated)] in address order) of every segment."""
    listed = []
    for segment in sim.segments:
        blocks, block = [], segment.first
        while block is not None:
            blocks.append((block.size, block.allocated))
            block = block.next
        listed.append((segment.size, blocks))
    return listed


def replay_with_segments(requests: list[Request], labels: dict[int, str]):
    """Replay ``requests``; the new-segment events (request index, label, bytes, reserved
    after) and the segment list at the reserved peak."""
    sim = CachingAllocator(AllocatorConfig())
    live, grown, at_peak = {}, [], []
    for index, request in enumerate(requests):
        if request.empty_cache:
            sim.empty_cache()
        elif request.is_alloc and request.size:
            before = sim.stats.reserved
            live[request.key] = (sim.malloc(request.size, request.stream), request.size)
            if sim.stats.reserved > before:
                grown.append((index, labels.get(request.key, ""), request.size, sim.stats.reserved))
                if sim.stats.reserved == sim.stats.peak_reserved:
                    at_peak = segment_list(sim)
        elif request.key in live:
            sim.free(*live.pop(request.key))
    return sim.stats, grown, at_peak


def _block(size: int, allocated: bool) -> str:
    return f"{size / MIB:.2f}{'A' if allocated else 'f'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("-b", "--batch-size", type=int, default=1)
    parser.add_argument("-s", "--seq-len", type=int)
    parser.add_argument("--input-shape")
    parser.add_argument("-p", "--precision", default="fp32")
    parser.add_argument("-o", "--optimizer", default="adamw")
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--stack")
    args = parser.parse_args()
    shape = tuple(int(n) for n in args.input_shape.split("x")) if args.input_shape else None
    recipe = Recipe(
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        input_shape=shape,
        precision=args.precision,
        optimizer=args.optimizer,
    )
    options = device_options(gpu=args.gpu, stack=args.stack)
    estimate, trace = trace_and_estimate(resolve(args.model, recipe), recipe, "cuda", options)
    on_device = device_trace(
        trace, options.card, options.cudnn_benchmark, "central", options.measured
    )
    labels = {
        a.id: f"{a.op} {a.phase} {a.iteration} {a.module}".strip()
        for a in on_device.trace.allocations
    }
    stats, grown, at_peak = replay_with_segments(requests_of(on_device), labels)
    held = stats.allocated_at_peak_reserved / MIB
    print(
        f"estimate reserved {estimate.peak.reserved_bytes / MIB:.0f} MiB (central replay "
        f"{stats.peak_reserved / MIB:.0f}, allocated while held {held:.0f})"
    )
    print("new segments: request, what, MiB, reserved after")
    for index, label, size, reserved in grown:
        print(f"  {index:6d}  {label:60s} {size / MIB:10.2f} {reserved / MIB:10.0f}")
    print("segments at the reserved peak (MiB): blocks in address order")
    for size, blocks in sorted(at_peak, key=lambda s: -s[0]):
        print(f"  {size / MIB:8.0f}: " + " ".join(_block(*b) for b in blocks))


if __name__ == "__main__":
    main()
