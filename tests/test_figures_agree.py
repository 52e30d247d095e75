"""Figures that must not contradict each other: reserved and the device total come from
the same allocator replay, even when the card forces the allocator to free its cache."""

from __future__ import annotations

from vramplan.device.options import device_options
from vramplan.device.replay import apply_device
from vramplan.pipeline import estimate_from_trace
from vramplan.recipe import Recipe
from vramplan.result import ModelInfo
from vramplan.trace.events import Allocation, PhaseMark, Trace

MIB = 2**20


def _fragmenting_trace() -> Trace:
    """A 30 MiB temporary freed, then a 40 MiB one: the unlimited allocator keeps the
    30 MiB segment cached (70 MiB reserved); on a small card it frees it and retries."""
    first = Allocation(0, 30 * MIB, "temporaries", "forward", 1, "m", "aten.empty", 0, 1)
    second = Allocation(1, 40 * MIB, "temporaries", "forward", 1, "m", "aten.empty", 2, 3)
    return Trace((first, second), (PhaseMark(0, "forward", 1),), 4)


def _judged(total_bytes: int):
    trace = _fragmenting_trace()
    info = ModelInfo("synthetic", 0, 0, 0)
    estimate = estimate_from_trace(trace, info, Recipe(), "cuda", [])
    options = device_options(gpu_memory=f"{total_bytes}B", headroom=0.0)
    return apply_device(estimate, trace, options)


def _card_with_room_for(segments: int):
    """The estimate on a card whose allocator may reserve ``segments`` bytes beside the
    runtime (the driver's reserve scales with the card, so settle it), and the card."""
    card = 2**30
    for _ in range(4):
        judged = _judged(card)
        outside = judged.peak.device_total_bytes - judged.peak.reserved_bytes
        counted = judged.runtime["driver_reserved"]
        card += outside - counted + segments - judged.details["usable_capacity_bytes"]
    return _judged(card), card


def test_reserved_comes_from_the_replay_the_device_total_comes_from():
    free = _judged(80 * 2**30)
    assert free.peak.reserved_bytes == 70 * MIB  # both segments cached, no card limit
    # room for 50 MiB of segments: the allocator frees the 30 MiB one and retries
    tight, card = _card_with_room_for(50 * MIB)
    outside = tight.peak.device_total_bytes - tight.peak.reserved_bytes
    counted = tight.runtime["driver_reserved"]
    assert tight.verdict.status != "oom"
    assert tight.details["allocator"]["alloc_retries"] == 1
    assert tight.peak.reserved_bytes == 40 * MIB
    assert tight.peak.reserved_bytes + outside == tight.peak.device_total_bytes <= card
    assert tight.peak.device_total_bytes - counted <= tight.details["usable_capacity_bytes"]
    assert tight.peak.allocated_bytes <= tight.peak.reserved_bytes
    low, high = tight.peak.reserved_range_bytes
    assert low <= tight.peak.reserved_bytes <= high


def test_without_retries_the_figures_are_unchanged():
    free = _judged(80 * 2**30)
    roomy = _judged(free.peak.device_total_bytes + 100 * MIB)
    assert roomy.peak == free.peak
    assert roomy.details["allocator"]["alloc_retries"] == 0


def test_a_step_that_runs_out_after_retrying_is_not_said_to_fit():
    """Room for 35 MiB of segments: the allocator frees the cached 30 MiB one, retries,
    and still cannot place the 40 MiB request."""
    short, _ = _card_with_room_for(35 * MIB)
    assert short.verdict.status == "oom"
    assert short.details["allocator"]["alloc_retries"] == 1
    assert not [note for note in short.notes if note.startswith("fits only after")]
    fits, _ = _card_with_room_for(50 * MIB)
    assert [note for note in fits.notes if note.startswith("fits only after")]
