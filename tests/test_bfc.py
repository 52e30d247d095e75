"""TensorFlow's BFC allocator rules (xla/tsl/framework/bfc_allocator.cc), by exact
arithmetic on small request sequences."""

from __future__ import annotations

from vramplan.device.bfc import BfcAllocator, bfc_replay, bin_for, rounded_bytes
from vramplan.device.tensorflow import min_system_memory

MiB = 2**20


def test_rounding_and_bins():
    assert [rounded_bytes(n) for n in (1, 255, 256, 257, 1000)] == [256, 256, 256, 512, 1024]
    # bin b holds chunks of [256 << b, 256 << (b + 1)); the last bin takes the rest
    assert [bin_for(256 << b) for b in range(21)] == list(range(21))
    assert bin_for((256 << 3) * 2 - 1) == 3
    assert bin_for(256 << 30) == 20


def test_growth_regions_double():
    # memory growth: regions of 2, 4, 8 MiB... each Extend doubles the next region; the
    # 4 MiB region is split and holds the second and third 2 MiB tensors
    allocator = BfcAllocator(limit=1024 * MiB, growth=True)
    for _ in range(4):
        allocator.malloc(2 * MiB)
    assert sorted(allocator.regions.values()) == [2 * MiB, 4 * MiB, 8 * MiB]
    assert allocator.pool == 14 * MiB


def test_request_larger_than_region_doubles_until_it_fits():
    allocator = BfcAllocator(limit=1024 * MiB, growth=True)
    allocator.malloc(9 * MiB)  # 2 → 4 → 8 → 16 MiB; not doubled again after growing
    allocator.malloc(20 * MiB)  # no room in the 16 MiB region: 16 → 32 MiB
    assert list(allocator.regions.values()) == [16 * MiB, 32 * MiB]


def test_preallocation_takes_the_whole_limit_at_once():
    result = bfc_replay([(0, 1000, True)], limit=512 * MiB, growth=False)
    assert (result.peak_pool_bytes, result.regions) == (512 * MiB, 1)


def test_split_only_when_twice_the_request_or_128_mib_spare():
    allocator = BfcAllocator(limit=1024 * MiB, growth=True)
    whole = allocator.malloc(3 * MiB)  # a 4 MiB region: 4 < 2 * 3 and 1 MiB spare: kept whole
    assert whole.size == 4 * MiB
    allocator.free(whole)
    part = allocator.malloc(1 * MiB)  # 4 >= 2 * 1: split
    assert part.size == 1 * MiB


def test_freed_neighbours_coalesce():
    allocator = BfcAllocator(limit=64 * MiB, growth=False)
    a, b, c = (allocator.malloc(MiB) for _ in range(3))
    allocator.free(a)
    allocator.free(c)
    allocator.free(b)  # merges with both sides, then with the region's free tail
    assert list(allocator.free_chunks.values())[0].size == 64 * MiB
    assert allocator.in_use == 0


def test_out_of_memory_and_optional_scratch():
    requests = [(0, 40 * MiB, True), (1, 40 * MiB, True, True), (2, 30 * MiB, True)]
    result = bfc_replay(requests, limit=64 * MiB, growth=False)
    # the optional 40 MiB scratch does not fit and is skipped; the 30 MiB tensor fails
    assert result.oom_at == 2


def test_idle_regions_are_returned_before_failing():
    # growth: 2 MiB then 4 MiB regions; with both idle, a 6 MiB request within an 8 MiB
    # limit fits only once they are returned (DeallocateFreeRegions)
    requests = [(0, 2 * MiB, True), (1, 4 * MiB, True), (0, 0, False), (1, 0, False)]
    result = bfc_replay([*requests, (2, 6 * MiB, True)], limit=8 * MiB, growth=True)
    assert result.oom_at is None


def test_min_system_memory():
    # gpu_device.cc MinSystemMemory: 225 MiB under 2 GiB free, else by compute capability
    assert min_system_memory(2**31 - 1, 8) == 225 * MiB
    assert [min_system_memory(16 * 2**30, cc) for cc in (6, 7, 8, 9)] == [
        500 * MiB,
        1050 * MiB,
        1536 * MiB,
        1800 * MiB,
    ]
