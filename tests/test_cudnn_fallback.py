"""cuDNN without benchmark falls back to the next engine when a workspace cannot be
allocated (``Conv_v8.cpp``: ``run_conv_plan`` allocates through the caching allocator,
``try_configs`` catches ``OutOfMemoryError`` and tries the next config): the replay
serves the largest reading that fits the device, after freeing the cache, and a
workspace never turns a step that fits into an OOM. Ground truth: exact arithmetic of
the allocator's 20 MiB / 2 MiB segment rules."""

from vramplan.device.allocator import AllocatorConfig, Request, replay
from vramplan.device.cudnn import Workspace

MiB = 2**20


def _step(workspace: int, fallbacks: tuple[int, ...]) -> list[Request]:
    """A 60 MiB activation kept, a 30 MiB temporary freed (cached), then one convolution
    whose workspace is ``workspace`` with ``fallbacks``."""
    return [
        Request(0, 60 * MiB, True),
        Request(1, 30 * MiB, True),
        Request(1, 30 * MiB, False),
        Request(2, workspace, True, fallbacks=fallbacks),
        Request(2, workspace, False),
    ]


def test_the_engines_own_workspace_is_used_when_it_fits():
    result = replay(_step(200 * MiB, (8 * MiB, 0)), AllocatorConfig(), device_free=1024 * MiB)
    assert result.block_sizes[2] == 200 * MiB
    assert result.stats.peak_reserved == (60 + 30 + 200) * MiB


def test_a_workspace_too_big_for_the_card_falls_to_the_next_engine():
    # 90 MiB reserved; a 200 MiB workspace cannot fit under 256 MiB even after the
    # cached 30 MiB segment is released (the allocator's retry), so the 8 MiB engine
    # runs, in a fresh 20 MiB segment: reserved ends at 60 + 20 and never passed 90.
    result = replay(_step(200 * MiB, (8 * MiB, 0)), AllocatorConfig(), device_free=256 * MiB)
    assert result.oom_at is None
    assert result.block_sizes[2] == 8 * MiB
    assert result.stats.peak_reserved == 90 * MiB
    assert result.stats.reserved == 80 * MiB
    assert result.stats.num_alloc_retries == 1


def test_the_cache_is_freed_before_the_engine_gives_up():
    # 60 + 30 (cached) reserved; 150 MiB fits under 220 only once the cached 30 MiB
    # segment is released (the allocator's retry), so the heuristic's engine runs.
    result = replay(_step(150 * MiB, (8 * MiB, 0)), AllocatorConfig(), device_free=220 * MiB)
    assert result.block_sizes[2] == 150 * MiB
    assert result.stats.peak_reserved == (60 + 150) * MiB
    assert result.stats.num_alloc_retries == 1


def test_a_workspace_of_nothing_is_the_last_resort():
    result = replay(_step(500 * MiB, (0,)), AllocatorConfig(), device_free=100 * MiB)
    assert result.oom_at is None
    assert 2 not in result.block_sizes
    assert result.stats.peak_reserved == 90 * MiB


def test_fallbacks_are_the_smaller_readings_largest_first():
    workspace = Workspace(0, 8 * MiB, 900 * MiB, (), "model")
    assert workspace.smaller_than(900 * MiB) == (8 * MiB, 0)
    assert workspace.smaller_than(8 * MiB) == (0,)
    assert workspace.smaller_than(0) == ()
