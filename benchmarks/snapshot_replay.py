"""Replay a real CUDA memory snapshot's allocations through vramplan's allocator simulation,
from the state the allocator was in when history recording began (prints only).

A snapshot (``torch.cuda.memory._snapshot()``, as ``vramplan measure --snapshot`` dumps it)
holds the segments at its end and the allocator's trace since recording began. The start
state is rebuilt from both: the segments no ``segment_alloc`` of the trace created, and the
blocks live then (those the trace frees before it allocates there, and those still active
at the end that the trace never touched). The trace's requests are then replayed in order;
with ``--release-cached`` the segments holding no live block at the start are dropped
first (``torch.cuda.empty_cache()`` before the step)::

    PYTHONPATH=src python benchmarks/snapshot_replay.py tinyllama.pickle.gz

The history must be complete (``max_entries`` larger than the trace) for the start state
to be right. With ``--row`` (the measured row's JSON, ``vramplan measure --json``) and the
card and stack it ran on, the same requests are also replayed from the state the
estimate's setup leaves (its weights allocated in order, nothing else cached): what the
step reserves when only the start state differs::

    PYTHONPATH=src python benchmarks/snapshot_replay.py snapshots/qwen.pickle.gz \
        --row rows/qwen.json --gpu h200 --stack torch2.11-cu13.0
"""

from __future__ import annotations

import argparse
import gzip
import json
import pickle
from dataclasses import dataclass
from pathlib import Path

from vramplan.device.allocator import (
    AllocatorConfig,
    Block,
    CachingAllocator,
    Segment,
    round_size,
)
from vramplan.device.options import device_options
from vramplan.device.replay import device_trace, requests_of
from vramplan.pipeline import trace_and_estimate
from vramplan.recipe import Recipe
from vramplan.result import Component, Phase
from vramplan.sources import resolve

MIB = 2**20


@dataclass(frozen=True)
class SnapshotReplay:
    """Reserved and allocated bytes of a replayed snapshot trace."""

    start_reserved: int
    peak_reserved: int
    peak_allocated: int
    end_reserved: int
    recorded_reserved: int
    """What the snapshot's own segments hold at its end."""


def load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as handle:
        return pickle.load(handle)


def _start_state(snapshot: dict) -> tuple[list[dict], dict[int, int]]:
    """The segments that existed when recording began, and the blocks live then
    (address → requested bytes)."""
    trace = snapshot["device_traces"][0]
    first: dict[int, dict] = {}
    for event in trace:
        if event["action"] in ("alloc", "free_completed"):
            first.setdefault(event["addr"], event)
    live = {addr: e["size"] for addr, e in first.items() if e["action"] == "free_completed"}
    for segment in snapshot["segments"]:
        address = segment["address"]
        for block in segment["blocks"]:
            if block["state"] == "active_allocated" and address not in first:
                live[address] = block["requested_size"]
            address += block["size"]
    created = {e["addr"] for e in trace if e["action"] == "segment_alloc"}
    return [s for s in snapshot["segments"] if s["address"] not in created], live


def _seed(sim: CachingAllocator, segment: dict, live: dict[int, int]) -> dict[int, Block]:
    """Put one recorded segment into ``sim``: its live blocks allocated, the gaps free."""
    base, total = segment["address"], segment["total_size"]
    small = segment["segment_type"] == "small"
    seg = Segment(base, total, small)
    pool = sim.small if small else sim.large
    pieces, position = [], base
    for address in sorted(a for a in live if base <= a < base + total):
        size = round_size(live[address], sim.config)
        if address > position:
            pieces.append((position, address - position, False))
        pieces.append((address, size, True))
        position = address + size
    if position < base + total:
        pieces.append((position, base + total - position, False))
    blocks, previous = {}, None
    for address, size, allocated in pieces:
        block = Block(seg, address, size, allocated=allocated, prev=previous)
        if previous is None:
            seg.first = block
        else:
            previous.next = block
        previous = block
        if allocated:
            blocks[address] = block
            sim.stats.allocated += size
        else:
            pool.add(block)
    sim.segments.append(seg)
    sim.stats.reserved += total
    return blocks


def replay_snapshot(snapshot: dict, release_cached: bool = False) -> SnapshotReplay:
    """The snapshot's trace replayed from its start state (see the module's docstring)."""
    segments, live = _start_state(snapshot)
    sim = CachingAllocator(AllocatorConfig())
    blocks: dict[int, Block] = {}
    for segment in segments:
        holds = any(
            segment["address"] <= a < segment["address"] + segment["total_size"] for a in live
        )
        if holds or not release_cached:
            blocks.update(_seed(sim, segment, live))
    sim.stats.peak_reserved, sim.stats.peak_allocated = sim.stats.reserved, sim.stats.allocated
    start = sim.stats.reserved
    replay_from(sim, snapshot, blocks)
    return SnapshotReplay(
        start_reserved=start,
        peak_reserved=sim.stats.peak_reserved,
        peak_allocated=sim.stats.peak_allocated,
        end_reserved=sim.stats.reserved,
        recorded_reserved=sum(s["total_size"] for s in snapshot["segments"]),
    )


def estimate_setup(row_path: str, gpu: str, stack: str) -> tuple[CachingAllocator, int]:
    """The allocator as the estimate of a measured row leaves it once its weights are
    placed (the setup's parameters and buffers; the batch the recorded run makes itself),
    and the estimate's reserved peak."""
    row = json.loads(Path(row_path).read_text())["estimate"]
    fields = {k: v for k, v in row["recipe"].items() if v is not None}
    if fields.get("input_shape"):
        fields["input_shape"] = tuple(fields["input_shape"])
    recipe = Recipe(**fields)
    options = device_options(gpu=gpu, stack=stack)
    built = resolve(row["model"]["name"], recipe)
    estimate, trace = trace_and_estimate(built, recipe, "cuda", options)
    on_device = device_trace(trace, options.card, options.cudnn_benchmark, "central")
    kinds = {a.id: (a.phase, a.category) for a in on_device.trace.allocations}
    sim, live = CachingAllocator(AllocatorConfig()), {}
    for request in requests_of(on_device):
        phase, category = kinds.get(request.key, (None, None))
        if request.is_alloc and phase != Phase.SETUP:
            break
        if request.is_alloc and category in (Component.PARAMETERS, Component.BUFFERS):
            live[request.key] = sim.malloc(request.size, request.stream)
        elif request.key in live:
            sim.free(live.pop(request.key))
    return sim, estimate.peak.reserved_bytes


def replay_from(sim: CachingAllocator, snapshot: dict, blocks: dict | None = None) -> int:
    """The reserved peak of the snapshot's requests replayed on ``sim`` as it stands
    (``blocks``: the blocks live at the start, by address)."""
    blocks = {} if blocks is None else blocks
    for event in snapshot["device_traces"][0]:
        if event["action"] == "alloc":
            blocks[event["addr"]] = sim.malloc(event["size"], 0)
        elif event["action"] == "free_completed" and event["addr"] in blocks:
            sim.free(blocks.pop(event["addr"]))
    return sim.stats.peak_reserved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("snapshot", help="a pickled torch.cuda.memory._snapshot() (.gz too)")
    parser.add_argument("--row", help="the measured row's JSON: replay from its estimate's setup")
    parser.add_argument("--gpu", default="h200")
    parser.add_argument("--stack")
    args = parser.parse_args()
    snapshot = load(args.snapshot)
    if args.row:
        sim, estimated = estimate_setup(args.row, args.gpu, args.stack)
        start = sim.stats.reserved
        peak = replay_from(sim, snapshot)
        print(
            f"{'from the estimate setup':24s} start {start / MIB:8.0f} MiB  peak reserved "
            f"{peak / MIB:8.0f}  (the estimate's: {estimated / MIB:.0f})"
        )
    for release in (False, True):
        r = replay_snapshot(snapshot, release)
        label = "cache released at start" if release else "as recorded"
        print(
            f"{label:24s} start {r.start_reserved / MIB:8.0f} MiB  peak reserved "
            f"{r.peak_reserved / MIB:8.0f}  peak allocated {r.peak_allocated / MIB:8.0f}  "
            f"end {r.end_reserved / MIB:8.0f}  (snapshot's segments: "
            f"{r.recorded_reserved / MIB:.0f})"
        )


if __name__ == "__main__":
    main()
