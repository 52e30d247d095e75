"""The caching-allocator simulation on hand-written sequences whose figures follow from
PyTorch's documented rules (CUDACachingAllocator.cpp; research/runtime.md §1)."""

from __future__ import annotations

import random

import pytest

from vramplan.device.allocator import (
    MB,
    SEGMENT_SPACING,
    AllocatorConfig,
    CachingAllocator,
    OutOfMemory,
    Request,
    pool_key,
    replay,
    round_size,
    segment_size,
)
from vramplan.errors import UserError

DEFAULT = AllocatorConfig()


@pytest.mark.parametrize(
    "size,expected", [(1, 512), (512, 512), (513, 1024), (1200, 1536), (MB + 1, MB + 512)]
)
def test_rounding_to_512(size, expected):
    assert round_size(size, DEFAULT) == expected


def test_roundup_power2_divisions():
    four = AllocatorConfig.parse("roundup_power2_divisions:4")
    # The docs' example (1200 -> 1280 with 4 divisions) as the code applies it: only sizes
    # above 512 * divisions are divided, so 1200 B rounds to 1536 but 1200 KiB to 1280 KiB.
    assert round_size(1200, four) == 1536
    assert round_size(1200 * 1024, four) == 1280 * 1024
    assert round_size(1200 * MB, four) == 1280 * MB
    assert round_size(1024 * MB, four) == 1024 * MB  # powers of two are kept
    listed = AllocatorConfig.parse("roundup_power2_divisions:[256:1,512:2,>:8]")
    assert listed.divisions_for(100 * MB) == 1  # the first key fills the lower slots
    assert listed.divisions_for(600 * MB) == 2
    assert listed.divisions_for(3000 * MB) == 8


@pytest.mark.parametrize(
    "rounded,segment",
    [
        (512, 2 * MB),
        (MB, 2 * MB),
        (MB + 512, 20 * MB),
        (10 * MB - 512, 20 * MB),
        (10 * MB, 10 * MB),
        (11 * MB + 512, 12 * MB),
    ],
)
def test_segment_sizes(rounded, segment):
    assert segment_size(rounded) == segment


def test_small_requests_share_a_2mib_segment():
    sim = CachingAllocator(DEFAULT)
    blocks = [sim.malloc(100_000) for _ in range(20)]  # 20 x 100,352 B < 2 MiB
    assert sim.stats.reserved == 2 * MB
    assert sim.stats.allocated == 20 * round_size(100_000, DEFAULT)
    sim.malloc(200_000)  # no longer fits in what is left: a second small segment
    assert sim.stats.reserved == 4 * MB
    assert len(blocks) == 20


def test_mid_requests_take_20mib_segments_and_split():
    sim = CachingAllocator(DEFAULT)
    first = sim.malloc(3 * MB)
    assert (sim.stats.reserved, first.size) == (20 * MB, 3 * MB)
    sim.malloc(5 * MB)  # served from the 17 MiB remainder
    assert sim.stats.reserved == 20 * MB
    sim.malloc(13 * MB)  # 12 MiB left is too small: a new 14 MiB segment (2 MiB rounding)
    assert sim.stats.reserved == 20 * MB + 14 * MB


def test_large_remainder_of_one_mib_is_not_split():
    sim = CachingAllocator(DEFAULT)
    block = sim.malloc(11 * MB)  # 12 MiB segment, 1 MiB left is not > 1 MiB
    assert block.size == 12 * MB
    assert sim.stats.allocated == 12 * MB


def test_free_blocks_coalesce_and_are_reused():
    sim = CachingAllocator(DEFAULT)
    a, b = sim.malloc(4 * MB), sim.malloc(4 * MB)
    sim.malloc(4 * MB)
    sim.free(a, 4 * MB)
    sim.free(b, 4 * MB)  # merges with a: one free 8 MiB block at the segment's start
    c = sim.malloc(8 * MB)
    assert c.address == a.address and c.size == 8 * MB
    assert sim.stats.reserved == 20 * MB


def test_best_fit_prefers_the_smallest_block():
    sim = CachingAllocator(DEFAULT)
    big = sim.malloc(30 * MB)
    small = sim.malloc(12 * MB)
    sim.free(big, 30 * MB)
    sim.free(small, 12 * MB)
    reused = sim.malloc(11 * MB)
    assert reused.segment is small.segment


def test_pool_keys_sort_as_stream_size_address_tuples():
    # PyTorch's BlockComparatorSize orders a pool by (stream, size, address); the packed int
    # keys must order the same, up to the largest simulated addresses (segments placed
    # below start 2**20 spacings up) and sizes beyond any card.
    rng = random.Random(7)
    top = 2**20 * SEGMENT_SPACING + 2**45
    triples = [(rng.randrange(4), rng.randrange(1, 2**50), rng.randrange(top)) for _ in range(2000)]
    triples += [(0, 512, 0), (0, 512, top), (1, 512, 0), (0, 2**50, top)]
    assert sorted(triples, key=lambda t: pool_key(*t)) == sorted(triples)


def test_max_split_size_keeps_oversize_blocks_whole():
    conf = AllocatorConfig.parse("max_split_size_mb:20")
    sim = CachingAllocator(conf)
    big = sim.malloc(40 * MB)
    sim.free(big, 40 * MB)
    sim.malloc(2 * MB)  # may not take the cached 40 MiB block: a new 20 MiB segment
    assert sim.stats.reserved == 60 * MB
    unlimited = CachingAllocator(DEFAULT)
    big = unlimited.malloc(40 * MB)
    unlimited.free(big, 40 * MB)
    unlimited.malloc(2 * MB)  # default: the cached block is split and reused
    assert unlimited.stats.reserved == 40 * MB


def test_expandable_segments_pack_tightly():
    sim = CachingAllocator(AllocatorConfig.parse("expandable_segments:True"))
    for _ in range(3):
        sim.malloc(7 * MB)  # 21 MiB in 20 MiB pages: two pages
    assert sim.stats.reserved == 40 * MB
    classic = CachingAllocator(DEFAULT)
    for _ in range(3):
        classic.malloc(7 * MB)  # two per 20 MiB segment
    assert classic.stats.reserved == 40 * MB
    sim2 = CachingAllocator(AllocatorConfig.parse("expandable_segments:True"))
    sim2.malloc(25 * MB)
    assert sim2.stats.reserved == 40 * MB  # 2 pages, where a classic segment is 26 MiB


def test_oom_path_releases_cached_segments_and_retries():
    sim = CachingAllocator(DEFAULT, capacity=40 * MB)
    a = sim.malloc(30 * MB)
    sim.free(a, 30 * MB)  # a cached, whole free 30 MiB segment
    block = sim.malloc(32 * MB)  # 30 + 32 > 40: release the cache, retry, succeed
    assert block.size == 32 * MB
    assert sim.stats.num_alloc_retries == 1
    assert sim.stats.reserved == 32 * MB
    with pytest.raises(OutOfMemory):
        sim.malloc(10 * MB)


def test_fragmentation_can_cause_oom():
    sim = CachingAllocator(DEFAULT, capacity=40 * MB)
    keep = [sim.malloc(5 * MB) for _ in range(8)]  # two 20 MiB segments, full
    for block in keep[::2]:
        sim.free(block, 5 * MB)  # 20 MiB free, but in 5 MiB holes
    with pytest.raises(OutOfMemory):
        sim.malloc(10 * MB)
    assert sim.stats.allocated == 20 * MB


def test_replay_reports_peaks_and_block_sizes():
    requests = [
        Request(0, 100, True),
        Request(1, 3 * MB, True),
        Request(0, 100, False),
        Request(2, 11 * MB, True),
        Request(1, 3 * MB, False),
        Request(2, 11 * MB, False),
    ]
    result = replay(requests, DEFAULT)
    assert result.block_sizes == {0: 512, 1: 3 * MB, 2: 11 * MB}
    assert result.stats.peak_reserved == 2 * MB + 20 * MB  # 11 MiB fits the 17 MiB remainder
    assert result.stats.peak_allocated == 3 * MB + 11 * MB
    assert result.oom_at is None
    assert replay(requests, DEFAULT, capacity=10 * MB).oom_at == 1


@pytest.mark.parametrize(
    "text,message",
    [
        ("foo", "cannot read"),
        ("max_split_size_mb:10", "at least 20"),
        ("expandable_segments:maybe", "True or False"),
        ("roundup_power2_divisions:3", "power of 2"),
        ("garbage_collection_threshold:1.5", "(0, 1)"),
        ("bogus_key:1", "unknown option"),
        ("roundup_power2_divisions:[256:1,512:2", "unterminated"),
    ],
)
def test_malformed_alloc_conf(text, message):
    with pytest.raises(UserError, match=None) as info:
        AllocatorConfig.parse(text)
    assert message in str(info.value)


def test_a_stream_reuses_only_its_own_cached_blocks():
    sim = CachingAllocator(AllocatorConfig())
    sim.free(sim.malloc(30 * MB, stream=1))  # a communication stream's buffer, cached
    sim.malloc(30 * MB, stream=0)  # compute cannot take it: a new segment
    assert sim.stats.reserved == 2 * 30 * MB
    sim.malloc(30 * MB, stream=1)  # the communication stream takes its own back
    assert sim.stats.reserved == 2 * 30 * MB and sim.stats.allocated == 2 * 30 * MB


def test_replay_keeps_streams_apart():
    size = 12 * MB
    same = replay(
        [Request(0, size, True), Request(0, size, False), Request(1, size, True)], AllocatorConfig()
    )
    apart = replay(
        [Request(0, size, True, stream=2), Request(0, size, False), Request(1, size, True)],
        AllocatorConfig(),
    )
    assert same.stats.peak_reserved == size
    assert apart.stats.peak_reserved == 2 * size


def test_fragmentation_is_measured_over_the_whole_reserved_peak():
    big, small = 50 * MB, 4096
    requests = [
        Request(0, big, True),
        Request(0, big, False),  # 50 MiB cached
        Request(1, small, True),  # a small segment: the reserved peak, 52 MiB
        Request(2, big, True),
    ]  # the peak is held and the cache refilled
    result = replay(requests, AllocatorConfig())
    assert result.stats.peak_reserved == big + 2 * MB
    assert result.fragmentation == 2 * MB - small


def test_cast_copies_stay_cached_until_the_cache_is_emptied():
    """Weights built in bf16, cast to fp32 and back (``model.float()`` then
    ``model.to(bfloat16)``), as TinyLlama's 22 MiB MLP matrices: each cast allocates the new
    copy before the old is freed, and a freed block stays cached (only ``empty_cache`` or
    the out-of-memory retry returns segments: ``release_cached_blocks``)."""
    bf16, fp32, count = 22 * MB, 44 * MB, 3
    sim = CachingAllocator(DEFAULT)
    weights = [sim.malloc(bf16) for _ in range(count)]  # one 22 MiB segment each
    copies = []
    for block in weights:  # .float(): no cached block of 44 MiB, a new segment each
        copies.append(sim.malloc(fp32))
        sim.free(block, bf16)
    weights = []
    for block in copies:  # .to(bfloat16): best fit is a cached 22 MiB block
        weights.append(sim.malloc(bf16))
        sim.free(block, fp32)
    assert sim.stats.allocated == count * bf16
    assert sim.stats.reserved == count * (bf16 + fp32)  # the fp32 segments, cached
    assert {b.segment.size for b in weights} == {bf16}
    sim.empty_cache()
    assert sim.stats.reserved == count * bf16


def test_a_late_cublas_workspace_pins_a_cached_workspace_segment():
    """A block kept from late in a step pins the cached segment it lands in. cuBLAS
    allocates its workspace at the first matmul (``getNewWorkspace``) and keeps it; VGG's
    first matmul follows its convolutions, so the 32 MiB takes the free tail of a cached
    cuDNN workspace segment (best fit, split since the rest exceeds 1 MiB). In VGG16 at
    batch 128 that displaces the weight gradients (kept until ``zero_grad``) into the tail
    of the 3136 MiB workspace segment, and backward's 3136 MiB workspace needs a new one.
    Here the workspace itself pins the segment: the next workspace of its size cannot fit."""
    ws, act, cublas = 100 * MB, 60 * MB, 32 * MB

    def reserved(cublas_first: bool) -> int:
        sim = CachingAllocator(DEFAULT)
        if cublas_first:  # created at the start of forward: a segment of its own
            sim.malloc(cublas)
        sim.free(sim.malloc(ws), ws)  # a forward convolution's workspace, cached
        activation = sim.malloc(act)  # carved from the cached 100 MiB segment
        if not cublas_first:  # the first matmul, later: the 40 MiB tail is the best fit
            assert sim.malloc(cublas).segment is activation.segment
        sim.free(activation, act)
        sim.free(sim.malloc(ws), ws)  # backward's workspace of the same size
        return sim.stats.peak_reserved

    assert reserved(cublas_first=True) == cublas + ws
    assert reserved(cublas_first=False) == ws + ws  # 60 + 8 MiB free around the 32 MiB


def test_equal_free_blocks_go_lowest_address_first_so_placement_can_pin_a_segment():
    """``BlockComparatorSize`` orders a pool by size, then address: of two equal free
    blocks the lower one is taken. VGG16 at batch 128 with ``cudnn.benchmark``: a 1.125 MiB
    weight gradient (kept until ``zero_grad``) has the 2 MiB free tails of a parameter
    segment and of a 3138 MiB activation segment to choose from; in the activation
    segment it survives the search's ``emptyCache()`` there and the next workspace of that
    size needs a new segment (measured 22218 MiB; 19082 with the gradient in the
    parameter segment, 22220 in the activation one). Here 20 and 100 MiB stand for them."""
    weight, grad, big = 9 * MB, 1152 * 1024, 100 * MB

    def reserved(new_segments_below: bool) -> tuple[int, int]:
        sim = CachingAllocator(DEFAULT, new_segments_below=new_segments_below)
        params = [sim.malloc(weight), sim.malloc(weight)]  # one 20 MiB segment, 2 MiB free
        sim.free(sim.malloc(big), big)  # a workspace, cached
        activation = sim.malloc(big - 2 * MB)  # its segment's 2 MiB tail stays free
        kept = sim.malloc(grad)  # best fit: one of the two 2 MiB tails, the lower
        lower = min(params[0].segment, activation.segment, key=lambda s: s.address)
        assert kept.size == 2 * MB and kept.segment is lower
        sim.free(activation, big - 2 * MB)
        sim.empty_cache()  # the benchmark search's emptyCache()
        after = sim.stats.reserved
        sim.free(sim.malloc(big), big)  # the next workspace of that size
        return after, sim.stats.peak_reserved

    assert reserved(new_segments_below=False) == (20 * MB, 120 * MB)  # the 100 MiB released
    assert reserved(new_segments_below=True) == (120 * MB, 220 * MB)  # pinned by the gradient
