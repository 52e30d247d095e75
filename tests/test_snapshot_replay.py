"""Replaying a CUDA memory snapshot's trace from its rebuilt start state
(benchmarks/snapshot_replay.py), on a hand-written snapshot whose figures follow from the
allocator's rules."""

from __future__ import annotations

from benchmarks.snapshot_replay import replay_snapshot

MB = 2**20


def _snapshot() -> dict:
    """A cached 44 MiB segment (an fp32 weight freed by a cast before recording began), a
    22 MiB segment holding the bf16 weight, and a step that allocates 30 MiB and frees it."""
    cached, weight = 1 << 40, 2 << 40
    return {
        "segments": [
            {
                "address": cached,
                "total_size": 44 * MB,
                "segment_type": "large",
                "blocks": [{"size": 44 * MB, "state": "inactive", "requested_size": 0}],
            },
            {
                "address": weight,
                "total_size": 22 * MB,
                "segment_type": "large",
                "blocks": [
                    {"size": 22 * MB, "state": "active_allocated", "requested_size": 22 * MB}
                ],
            },
        ],
        "device_traces": [
            [
                {"action": "alloc", "addr": cached, "size": 30 * MB},
                {"action": "free_requested", "addr": cached, "size": 30 * MB},
                {"action": "free_completed", "addr": cached, "size": 30 * MB},
            ]
        ],
    }


def test_the_recorded_step_reuses_the_cached_segment():
    result = replay_snapshot(_snapshot())
    assert result.start_reserved == result.peak_reserved == (44 + 22) * MB
    assert result.peak_allocated == (22 + 30) * MB
    assert result.recorded_reserved == result.end_reserved


def test_released_cache_makes_the_step_take_its_own_segment():
    result = replay_snapshot(_snapshot(), release_cached=True)
    assert result.start_reserved == 22 * MB  # only the segment holding the weight is kept
    assert result.peak_reserved == (22 + 30) * MB  # 30 MiB >= 10 MiB: its own segment
