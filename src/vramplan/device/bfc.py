"""TensorFlow's GPU allocator, the BFC ("best-fit with coalescing") allocator, replayed.

The rules, from ``xla/tsl/framework/bfc_allocator.cc`` (TensorFlow's
``tensorflow/core/common_runtime/bfc_allocator.cc`` before the move to TSL):

* every request is rounded up to a multiple of 256 bytes (``RoundedBytes``,
  ``kMinAllocationSize``);
* free chunks sit in 21 bins by size, bin ``b`` holding chunks of at least ``256 << b``
  bytes (``BinNumForSize``); a request takes the smallest free chunk that fits, searching
  from its own bin upwards, ties broken by address (``FindChunkPtr``);
* a chunk is split when it is at least twice the request or would waste 128 MiB or more
  (``ShouldSplitChunk``, ``max_internal_fragmentation_bytes_``); freed chunks merge with
  free neighbours of their region;
* when nothing fits, a region is added (``Extend``): ``curr_region_allocation_bytes_``,
  doubled until it holds the request, at most what is left under the memory limit, and
  doubled again for the next region. Without memory growth the first region is the whole
  limit; with it, the first is 2 MiB (``allow_growth``);
* before failing, regions holding nothing are returned and the region retried
  (``DeallocateFreeRegions``, on unless ``TF_ENABLE_GPU_GARBAGE_COLLECTION=false``).

Not modelled: ``TF_GPU_ALLOCATOR=cuda_malloc_async`` (CUDA's own pool), regions merged by
a sub-allocator that supports coalescing, the timestamped chunks of multi-stream use, and
the backpedal retry at 90% when cudaMalloc itself refuses a region.

>>> MiB = 2**20
>>> result = bfc_replay([(0, 3 * MiB, True), (0, 0, False)], limit=64 * MiB, growth=True)
>>> result.peak_pool_bytes // MiB, result.peak_in_use_bytes // MiB  # 4 MiB chunk, not split
(4, 4)
>>> bfc_replay([(0, 3 * MiB, True)], limit=64 * MiB, growth=False).peak_pool_bytes // MiB
64
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MIN_ALLOCATION = 256
BINS = 21
MAX_INTERNAL_FRAGMENTATION = 128 << 20
GROWTH_START = 2 << 20


def rounded_bytes(size: int) -> int:
    """``RoundedBytes``: up to a multiple of 256 (at least 256).

    >>> rounded_bytes(1), rounded_bytes(256), rounded_bytes(257)
    (256, 256, 512)
    """
    return max(MIN_ALLOCATION, -(-size // MIN_ALLOCATION) * MIN_ALLOCATION)


def bin_for(size: int) -> int:
    """``BinNumForSize``: floor(log2(size / 256)), capped at the last bin.

    >>> bin_for(256), bin_for(511), bin_for(512), bin_for(2**40)
    (0, 0, 1, 20)
    """
    return min(max(size >> 8, 1).bit_length() - 1, BINS - 1)


@dataclass
class Chunk:
    """A piece of one region: in use or free, linked to its neighbours."""

    ptr: int
    size: int
    region: int
    in_use: bool = False
    prev: Chunk | None = field(default=None, repr=False)
    next: Chunk | None = field(default=None, repr=False)


@dataclass(frozen=True)
class BfcResult:
    """What the allocator did: peaks of bytes in use (chunk sizes) and of the pool (the
    regions it took from the device), and the request that ran out of memory, if any."""

    peak_in_use_bytes: int
    peak_pool_bytes: int
    regions: int
    oom_at: int | None = None


class BfcAllocator:
    """The BFC allocator's bookkeeping over one memory ``limit`` (bytes)."""

    def __init__(self, limit: int, growth: bool, device_free: int | None = None) -> None:
        self.limit = limit
        self.device_free = limit if device_free is None else device_free
        self.region_bytes = rounded_bytes(min(limit, GROWTH_START) if growth else limit)
        self.bins: list[list[tuple[int, int]]] = [[] for _ in range(BINS)]
        self.free_chunks: dict[int, Chunk] = {}
        self.regions: dict[int, int] = {}
        self.next_ptr = 0
        self.pool = self.in_use = self.peak_pool = self.peak_in_use = 0

    def _insert(self, chunk: Chunk) -> None:
        bisect.insort(self.bins[bin_for(chunk.size)], (chunk.size, chunk.ptr))
        self.free_chunks[chunk.ptr] = chunk

    def _remove(self, chunk: Chunk) -> None:
        entries = self.bins[bin_for(chunk.size)]
        entries.pop(bisect.bisect_left(entries, (chunk.size, chunk.ptr)))
        del self.free_chunks[chunk.ptr]

    def _find(self, rounded: int) -> Chunk | None:
        for entries in self.bins[bin_for(rounded) :]:
            index = bisect.bisect_left(entries, (rounded, -1))
            if index < len(entries):
                chunk = self.free_chunks[entries[index][1]]
                self._remove(chunk)
                if chunk.size >= 2 * rounded or chunk.size - rounded >= MAX_INTERNAL_FRAGMENTATION:
                    rest = Chunk(chunk.ptr + rounded, chunk.size - rounded, chunk.region)
                    rest.prev, rest.next = chunk, chunk.next
                    if chunk.next is not None:
                        chunk.next.prev = rest
                    chunk.next, chunk.size = rest, rounded
                    self._insert(rest)
                chunk.in_use = True
                return chunk
        return None

    def _extend(self, rounded: int) -> bool:
        available = (self.limit - self.pool) // MIN_ALLOCATION * MIN_ALLOCATION
        if rounded > available:
            return False
        increased = False
        while rounded > self.region_bytes:
            self.region_bytes *= 2
            increased = True
        size = min(self.region_bytes, available, self.device_free - self.pool)
        if size < rounded:
            return False
        if not increased:
            self.region_bytes *= 2
        region = self.next_ptr
        self.next_ptr += size
        self.regions[region] = size
        self.pool += size
        self.peak_pool = max(self.peak_pool, self.pool)
        self._insert(Chunk(region, size, region))
        return True

    def _release_free_regions(self) -> bool:
        idle = [
            self.free_chunks[r]
            for r, size in self.regions.items()
            if r in self.free_chunks and self.free_chunks[r].size == size
        ]
        for chunk in idle:
            self._remove(chunk)
            self.pool -= self.regions.pop(chunk.region)
        return bool(idle)

    def malloc(self, size: int) -> Chunk | None:
        rounded = rounded_bytes(size)
        chunk = self._find(rounded)
        if chunk is None and self._extend(rounded):
            chunk = self._find(rounded)
        if chunk is None and self._release_free_regions() and self._extend(rounded):
            chunk = self._find(rounded)
        if chunk is not None:
            self.in_use += chunk.size
            self.peak_in_use = max(self.peak_in_use, self.in_use)
        return chunk

    def free(self, chunk: Chunk) -> None:
        self.in_use -= chunk.size
        chunk.in_use = False
        for neighbour in (chunk.next, chunk.prev):
            if neighbour is None or neighbour.in_use:
                continue
            self._remove(neighbour)
            first, second = (chunk, neighbour) if neighbour is chunk.next else (neighbour, chunk)
            first.size += second.size
            first.next = second.next
            if second.next is not None:
                second.next.prev = first
            chunk = first
        self._insert(chunk)


def bfc_replay(
    requests: list[tuple[int, int, bool]] | list[tuple[int, int, bool, bool]],
    limit: int,
    growth: bool,
    device_free: int | None = None,
) -> BfcResult:
    """Replay ``(key, bytes, is_alloc[, optional])`` requests (a free names its
    allocation's key) through a BFC allocator of ``limit`` bytes; stop at the first request
    that fails, unless it is ``optional`` (cuDNN scratch: TensorFlow allocates it without
    retry and falls back to an algorithm without scratch when it fails)."""
    allocator = BfcAllocator(limit, growth, device_free)
    live: dict[int, Chunk] = {}
    for position, (key, size, is_alloc, *rest) in enumerate(requests):
        if is_alloc:
            chunk = allocator.malloc(size)
            if chunk is None and rest and rest[0]:
                continue
            if chunk is None:
                return BfcResult(
                    allocator.peak_in_use, allocator.peak_pool, len(allocator.regions), position
                )
            live[key] = chunk
        elif key in live:
            allocator.free(live.pop(key))
    return BfcResult(allocator.peak_in_use, allocator.peak_pool, len(allocator.regions))
