"""A simulation of PyTorch's CUDA caching allocator, replayed over a trace.

The rules are those of PyTorch's own allocator, ``c10/cuda/CUDACachingAllocator.cpp``
(PyTorch 2.4–2.x: ``round_size``, ``get_allocation_size``, ``get_free_block``,
``should_split``, ``release_cached_blocks``): requests round up to 512 B (or to power-of-two
divisions), requests of at most 1 MiB use the small pool with 2 MiB segments, larger ones
the large pool with 20 MiB segments below 10 MiB and 2 MiB-rounded segments above; the
best-fitting cached block (smallest size, then lowest address) on the same stream is
reused and split when the remainder is worth keeping; freed blocks merge with free
neighbours of their segment; before an out-of-memory error, cached whole segments are
released and the allocation is retried::

    >>> sim = CachingAllocator(AllocatorConfig())
    >>> block = sim.malloc(100)
    >>> sim.stats.allocated, sim.stats.reserved
    (512, 2097152)
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, replace
from typing import NamedTuple

from vramplan.device.alloc_conf import (
    LARGE_BUFFER,
    MB,
    UNLIMITED,
    AllocatorConfig,
    is_power_of_two,
)

MIN_BLOCK = 512
SMALL_SIZE = 1 * MB
SMALL_BUFFER = 2 * MB
MIN_LARGE_ALLOC = 10 * MB
ROUND_LARGE = 2 * MB
SEGMENT_SPACING = 1 << 40  # simulated segments' addresses: far enough apart for any size


def round_size(size: int, config: AllocatorConfig) -> int:
    """The block size a request of ``size`` bytes is rounded to.

    >>> round_size(1200, AllocatorConfig())
    1536
    >>> round_size(1200 * 1024 * 1024, AllocatorConfig.parse("roundup_power2_divisions:4"))
    1342177280
    """
    if size < MIN_BLOCK:
        return MIN_BLOCK
    if not config.rounds_to_divisions:
        return -(-size // MIN_BLOCK) * MIN_BLOCK
    divisions = config.divisions_for(size)
    if divisions > 1 and size > MIN_BLOCK * divisions:
        if is_power_of_two(size):
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor // divisions
        if step == 0:
            return floor * 2
        rounded = size & ~(step - 1)
        return size if rounded == size else rounded + step
    return MIN_BLOCK * math.ceil(size / MIN_BLOCK)


def segment_size(rounded: int) -> int:
    """How much ``cudaMalloc`` asks for when no cached block fits a rounded request."""
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * math.ceil(rounded / ROUND_LARGE)


@dataclass(eq=False, slots=True)
class Block:
    """A piece of a segment, allocated or free."""

    segment: Segment
    address: int
    size: int
    allocated: bool = False
    prev: Block | None = None
    next: Block | None = None
    filed: int = 0
    """The key it was filed under in its pool (while free): ``pool_key``."""


@dataclass(eq=False, slots=True)
class Segment:
    """One ``cudaMalloc`` (or, expandable, one growing mapping)."""

    address: int
    size: int
    small: bool
    expandable: bool = False
    first: Block | None = None
    stream: int = 0
    """The stream that allocated it: its blocks serve only that stream's requests."""


@dataclass
class AllocatorStats:
    """The allocator's counters, named as in ``torch.cuda.memory_stats``."""

    allocated: int = 0
    reserved: int = 0
    requested: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    allocated_at_peak_reserved: int = 0
    reserved_at_peak_allocated: int = 0
    num_alloc_retries: int = 0
    num_ooms: int = 0
    num_device_alloc: int = 0
    num_device_free: int = 0


class OutOfMemory(Exception):
    """The simulated device cannot serve a request even after releasing the cache."""

    def __init__(self, requested: int, stats: AllocatorStats) -> None:
        super().__init__(f"out of memory serving {requested} bytes")
        self.requested = requested
        self.stats = stats


STREAM_SHIFT = 128
SIZE_SHIFT = 64
"""A free block's key packs (stream, size, address) into one int, which sorts as the tuple
would (sizes and simulated addresses stay below 2**64) and compares and hashes faster."""


def pool_key(stream: int, size: int, address: int) -> int:
    """The key a free block is filed under: sorting keys sorts by stream, size, address.

    >>> pool_key(0, 512, 2**40) < pool_key(0, 1024, 0) < pool_key(1, 512, 0)
    True
    """
    return (stream << STREAM_SHIFT) | (size << SIZE_SHIFT) | address


class _Pool:
    """Free blocks of one pool, ordered by (stream, size, address): best fit is a
    bisection within the requesting stream."""

    __slots__ = ("keys", "blocks")

    def __init__(self) -> None:
        self.keys: list[int] = []
        self.blocks: dict[int, Block] = {}

    def add(self, block: Block) -> None:
        key = block.filed = pool_key(block.segment.stream, block.size, block.address)
        bisect.insort(self.keys, key)
        self.blocks[key] = block

    def remove(self, block: Block) -> None:
        """Take out ``block``, filed under its key as it was when added (a block does not
        change while it is in a pool)."""
        key = block.filed
        keys = self.keys
        del keys[bisect.bisect_left(keys, key)]
        del self.blocks[key]

    def take_best_fit(self, size: int, stream: int, limit: int, non_split: int) -> Block | None:
        """Take out and return the stream's smallest free block of at least ``size`` bytes
        (lowest address among equals), unless ``get_free_block`` would refuse it: an
        oversize block (``limit``: ``max_split_size``) for a request below the limit, or one
        ``non_split`` bytes or more too big for an oversize request. One bisection finds
        and removes it: the replay's hot path."""
        keys = self.keys
        index = bisect.bisect_left(keys, (stream << STREAM_SHIFT) | (size << SIZE_SHIFT))
        if index == len(keys):
            return None
        key = keys[index]
        if key >> STREAM_SHIFT != stream:
            return None
        block = self.blocks[key]
        if size < limit <= block.size or (size >= limit and block.size >= size + non_split):
            return None
        del keys[index]
        del self.blocks[key]
        return block

    def sizes(self, stream: int) -> list[int]:
        """The sizes of the stream's free blocks."""
        mask = (1 << (STREAM_SHIFT - SIZE_SHIFT)) - 1
        return [(k >> SIZE_SHIFT) & mask for k in self.keys if k >> STREAM_SHIFT == stream]


class CachingAllocator:
    """The caching allocator of one device, fed requests in trace order. Each request
    names its stream (0: the default stream); a cached block serves only its own stream,
    as in PyTorch, so memory freed by a communication stream is not reused by compute.

    ``capacity`` is the memory the allocator may reserve (the card minus what the CUDA
    context and libraries hold); ``None`` means unlimited.

    Free blocks of the same size are taken lowest address first (``BlockComparatorSize``
    orders a pool by stream, size, then ``ptr``), so where ``cudaMalloc`` puts a segment
    decides which of two equal blocks a request gets. That is the CUDA driver's choice:
    by default each new segment lies above the earlier ones; ``new_segments_below`` puts
    each below them (the TinyLlama snapshot's fp32 cast copies, allocated after its bf16
    weights, lie below them).
    """

    def __init__(
        self,
        config: AllocatorConfig,
        capacity: int | None = None,
        new_segments_below: bool = False,
    ) -> None:
        self.config = config
        self.capacity = capacity
        self._plain_rounding = not config.rounds_to_divisions
        self._max_split = config.max_split_size
        self._non_split = config.max_non_split_rounding
        self.stats = AllocatorStats()
        self.small = _Pool()
        self.large = _Pool()
        self.segments: list[Segment] = []
        if new_segments_below:
            self._addresses = itertools.count(2**20 * SEGMENT_SPACING, -SEGMENT_SPACING)
        else:
            self._addresses = itertools.count(SEGMENT_SPACING, SEGMENT_SPACING)

    # -- public ------------------------------------------------------------------------
    def malloc(self, size: int, stream: int = 0) -> Block:
        """Serve a request of ``size`` bytes on ``stream``; raise ``OutOfMemory`` when it
        cannot."""
        if self._plain_rounding:  # round_size's common case, inline: the replay's hot path
            rounded = -(-size // MIN_BLOCK) * MIN_BLOCK or MIN_BLOCK
        else:
            rounded = round_size(size, self.config)
        small = rounded <= SMALL_SIZE
        pool = self.small if small else self.large
        block = pool.take_best_fit(rounded, stream, self._max_split, self._non_split)
        if block is None:
            block = self._new_block(rounded, small, stream, retry=False)
        if block is None and self._release_oversize(pool, rounded, stream):
            block = self._new_block(rounded, small, stream, retry=False)
        if block is None:
            self._release_cached()
            block = self._new_block(rounded, small, stream, retry=True)
        if block is None:
            self.stats.num_ooms += 1
            raise OutOfMemory(size, self.stats)
        block = self._split(block, rounded, pool)
        block.allocated = True
        stats = self.stats
        stats.allocated += block.size
        stats.requested += size
        self._note_peaks()
        return block

    def largest_free(self, stream: int = 0) -> int:
        """The largest cached free block of ``stream`` (``cacheInfo``'s max block)."""
        return max(self.small.sizes(stream) + self.large.sizes(stream), default=0)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``."""
        self._release_cached()

    def free(self, block: Block, requested: int = 0) -> None:
        """Return a block to its pool, merging it with free neighbours."""
        block.allocated = False
        stats = self.stats
        stats.allocated -= block.size
        stats.requested -= requested
        pool = self.small if block.segment.small else self.large
        before, after = block.prev, block.next
        if before is not None and not before.allocated:
            pool.remove(before)
            self._merge(block, before)
        if after is not None and not after.allocated:
            pool.remove(after)
            self._merge(block, after)
        pool.add(block)

    # -- internals ---------------------------------------------------------------------
    def _note_peaks(self) -> None:
        stats = self.stats
        if stats.allocated > stats.peak_allocated:
            stats.peak_allocated = stats.allocated
            stats.reserved_at_peak_allocated = stats.reserved
        if stats.reserved > stats.peak_reserved:
            stats.peak_reserved = stats.reserved
            stats.allocated_at_peak_reserved = stats.allocated
        elif stats.reserved == stats.peak_reserved:  # the most allocated while held
            stats.allocated_at_peak_reserved = max(
                stats.allocated_at_peak_reserved, stats.allocated
            )

    def _new_block(self, rounded: int, small: bool, stream: int, retry: bool) -> Block | None:
        if retry:
            self.stats.num_alloc_retries += 1
        if self.config.expandable_segments:
            return self._grow_expandable(rounded, small, stream)
        size = segment_size(rounded)
        if self.capacity is not None and self.stats.reserved + size > self.capacity:
            return None
        segment = Segment(next(self._addresses), size, small, stream=stream)
        segment.first = Block(segment, segment.address, size)
        self.segments.append(segment)
        self.stats.reserved += size
        self.stats.num_device_alloc += 1
        self._note_peaks()
        return segment.first

    def _grow_expandable(self, rounded: int, small: bool, stream: int) -> Block | None:
        """Map more pages at the end of the pool's one segment per stream (2 MiB small,
        20 MiB large)."""
        page = SMALL_BUFFER if small else LARGE_BUFFER
        segment = next(
            (s for s in self.segments if s.expandable and s.small == small and s.stream == stream),
            None,
        )
        if segment is None:
            segment = Segment(next(self._addresses), 0, small, expandable=True, stream=stream)
            self.segments.append(segment)
        tail = segment.first
        while tail is not None and tail.next is not None:
            tail = tail.next
        free_tail = tail if tail is not None and not tail.allocated else None
        have = free_tail.size if free_tail is not None else 0
        grow = page * math.ceil((rounded - have) / page)
        if self.capacity is not None and self.stats.reserved + grow > self.capacity:
            return None
        pool = self.small if small else self.large
        if free_tail is not None:
            pool.remove(free_tail)
            free_tail.size += grow
            block = free_tail
        else:
            block = Block(segment, segment.address + segment.size, grow, prev=tail)
            if tail is None:
                segment.first = block
            else:
                tail.next = block
        segment.size += grow
        self.stats.reserved += grow
        self.stats.num_device_alloc += 1
        self._note_peaks()
        return block

    def _split(self, block: Block, rounded: int, pool: _Pool) -> Block:
        remaining = block.size - rounded
        if block.segment.small or self.config.expandable_segments:
            worth = remaining >= MIN_BLOCK
        else:
            worth = rounded < self._max_split and remaining > SMALL_SIZE
        if not worth:
            return block
        rest = Block(block.segment, block.address + rounded, remaining, prev=block, next=block.next)
        if block.next is not None:
            block.next.prev = rest
        block.next = rest
        block.size = rounded
        pool.add(rest)
        return block

    @staticmethod
    def _merge(block: Block, neighbour: Block) -> None:
        if neighbour is block.prev:
            block.address = neighbour.address
            block.prev = neighbour.prev
            if neighbour.prev is not None:
                neighbour.prev.next = block
            if block.segment.first is neighbour:
                block.segment.first = block
        else:
            block.next = neighbour.next
            if neighbour.next is not None:
                neighbour.next.prev = block
        block.size += neighbour.size

    def _release_segment(self, segment: Segment) -> None:
        pool = self.small if segment.small else self.large
        pool.remove(segment.first)
        self.segments.remove(segment)
        self.stats.reserved -= segment.size
        self.stats.num_device_free += 1

    def _whole_free_segments(self) -> list[Segment]:
        return [
            s
            for s in self.segments
            if s.first is not None and s.first.next is None and not s.first.allocated
        ]

    def _release_oversize(self, pool: _Pool, rounded: int, stream: int) -> bool:
        """With ``max_split_size`` set: free one cached oversize segment of the stream big
        enough, or the largest ones until enough is freed
        (``release_available_cached_blocks``)."""
        limit = self.config.max_split_size
        if limit == UNLIMITED or self.config.expandable_segments:
            return False
        wanted = max(rounded, limit)
        candidates = sorted(
            (
                s
                for s in self._whole_free_segments()
                if s.small == (pool is self.small) and s.stream == stream and s.size >= limit
            ),
            key=lambda s: (s.size, s.address),
        )
        fitting = [s for s in candidates if s.size >= wanted]
        if fitting:
            self._release_segment(fitting[0])
            return True
        released = 0
        for segment in reversed(candidates):
            if released >= wanted:
                break
            self._release_segment(segment)
            released += segment.size
        return released >= wanted

    def _release_cached(self) -> None:
        """``empty_cache()``: free every segment that holds no allocated block; expandable
        segments unmap their free tail pages."""
        for segment in self._whole_free_segments():
            if not segment.expandable:
                self._release_segment(segment)
        for segment in [s for s in self.segments if s.expandable]:
            self._unmap_free_tail(segment)

    def _unmap_free_tail(self, segment: Segment) -> None:
        page = SMALL_BUFFER if segment.small else LARGE_BUFFER
        tail = segment.first
        while tail is not None and tail.next is not None:
            tail = tail.next
        if tail is None or tail.allocated:
            return
        pool = self.small if segment.small else self.large
        first_whole_page = page * math.ceil((tail.address - segment.address) / page)
        release = segment.size - first_whole_page
        if release <= 0:
            return
        pool.remove(tail)
        tail.size -= release
        segment.size -= release
        self.stats.reserved -= release
        self.stats.num_device_free += 1
        if tail.size > 0:
            pool.add(tail)
        elif tail.prev is not None:
            tail.prev.next = None
        else:
            segment.first = None


class Request(NamedTuple):
    """One step of a replay: allocate (``size`` bytes) or free the allocation ``key`` (a
    tuple: a replay feeds hundreds of thousands)."""

    key: int
    size: int
    is_alloc: bool
    stream: int = 0
    empty_cache: bool = False
    """``torch.cuda.empty_cache()`` (cuDNN's benchmark calls it after timing its plans):
    release every cached segment that holds no allocated block."""
    candidates: tuple[int, ...] = ()
    """cuDNN benchmark: allocate the largest candidate that fits
    ``max(device free, largest cached block)`` (``size`` is ignored)."""
    fallbacks: tuple[int, ...] = ()
    """cuDNN without benchmark: the next engines' workspaces, tried in order when ``size``
    cannot be allocated within the device (after the allocator frees its cache and
    retries, as ``malloc`` does before it raises)."""


@dataclass(frozen=True)
class ReplayResult:
    """What the allocator did over a whole replay."""

    stats: AllocatorStats
    block_sizes: dict[int, int]
    oom_at: int | None = None
    """Index (in the request list) of the allocation that ran out of memory, if any."""

    @property
    def fragmentation(self) -> int:
        """Reserved but unallocated bytes at the reserved peak: the peak less the most
        bytes allocated while it was held (reserved stays at its peak until released)."""
        return self.stats.peak_reserved - self.stats.allocated_at_peak_reserved


def replay(
    requests: list[Request],
    config: AllocatorConfig,
    capacity: int | None = None,
    device_free: int | None = None,
    new_segments_below: bool = False,
) -> ReplayResult:
    """Feed requests to a simulated allocator; stop at the first out-of-memory error.
    ``device_free`` bounds what cuDNN's benchmark sees as free device memory when no
    ``capacity`` is set (``None``: unbounded); ``new_segments_below`` places each new
    segment below the earlier ones (``CachingAllocator``).

    >>> result = replay([Request(0, 3 * 2**20, True), Request(0, 3 * 2**20, False)],
    ...                 AllocatorConfig())
    >>> result.stats.peak_reserved
    20971520
    """
    return Replay(config, capacity, device_free, new_segments_below).run(requests)


class Replay:
    """A replay that more requests can follow: ``run`` feeds them to the same allocator,
    its cache and live blocks as the earlier ones left them, and gives the figures so far
    (a copy, which later runs leave alone). The step's other orders that begin as the step
    does (``orders.py``: more iterations) continue its replay instead of replaying it
    again::

        >>> MiB = 2**20
        >>> step = Replay(AllocatorConfig())
        >>> step.run([Request(0, 3 * MiB, True)]).stats.peak_reserved // MiB
        20
        >>> more = [Request(0, 3 * MiB, False), Request(1, 30 * MiB, True)]
        >>> step.run(more).stats.peak_reserved // MiB  # the 20 MiB segment is still held
        50
    """

    def __init__(
        self,
        config: AllocatorConfig,
        capacity: int | None = None,
        device_free: int | None = None,
        new_segments_below: bool = False,
    ) -> None:
        self.allocator = CachingAllocator(config, capacity, new_segments_below)
        self.live: dict[int, tuple[Block, int]] = {}
        self.sizes: dict[int, int] = {}
        self.limit = capacity if capacity is not None else device_free

    def run(self, requests: list[Request]) -> ReplayResult:
        """Feed ``requests``; stop at the first out-of-memory error (its index in them)."""
        allocator, live, sizes, limit = self.allocator, self.live, self.sizes, self.limit
        malloc, free = allocator.malloc, allocator.free
        for position, (key, size, is_alloc, stream, empty, candidates, fallbacks) in enumerate(
            requests
        ):
            if empty:
                allocator.empty_cache()
                continue
            if candidates:
                free_bytes = math.inf if limit is None else limit - allocator.stats.reserved
                available = max(free_bytes, allocator.largest_free(stream))
                size = max((c for c in candidates if c <= available), default=0)
            if size == 0:
                continue
            if is_alloc:
                try:
                    if fallbacks and limit is not None:
                        block, size = _first_that_fits(allocator, (size, *fallbacks), limit, stream)
                        if block is None:
                            continue
                    else:
                        block = malloc(size, stream)
                except OutOfMemory:
                    return self._result(oom_at=position)
                live[key] = (block, size)
                sizes[key] = block.size
            elif key in live:
                block, size = live.pop(key)
                free(block, size)
        return self._result()

    def _result(self, oom_at: int | None = None) -> ReplayResult:
        return ReplayResult(replace(self.allocator.stats), dict(self.sizes), oom_at)


def _first_that_fits(
    allocator: CachingAllocator, sizes: tuple[int, ...], limit: int, stream: int
) -> tuple[Block | None, int]:
    """The block of the first of ``sizes`` the allocator can serve within ``limit`` (it
    frees its cache and retries before failing), and that size; the last size is served
    under the allocator's own capacity (its failure is the step's OOM; 0: no block).
    With benchmark off, PyTorch's cuDNN v8 path allocates each config's workspace in
    ``run_conv_plan`` and, when that raises ``OutOfMemoryError``, ``try_configs`` runs
    the next config of the heuristic's list (``aten/src/ATen/native/cudnn/Conv_v8.cpp``;
    ../shared/research/cudnn-and-floor.md)."""
    capacity = allocator.capacity
    allocator.capacity = limit if capacity is None else min(capacity, limit)
    try:
        for size in sizes[:-1]:
            try:
                return allocator.malloc(size, stream), size
            except OutOfMemory:
                continue
    finally:
        allocator.capacity = capacity
    if sizes[-1] == 0:
        return None, 0
    return allocator.malloc(sizes[-1], stream), sizes[-1]
