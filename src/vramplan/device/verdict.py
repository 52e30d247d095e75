"""The verdict: does the step fit a card once a headroom margin is kept free?

    >>> judge("T4", 16 * 2**30, 0.10, 15 * 2**30).status
    'tight'
"""

from __future__ import annotations

from vramplan.result import Verdict


def judge(
    gpu: str, capacity: int, headroom: float, device_total: int, allocator_oom: bool | None = None
) -> Verdict:
    """FITS under the headroom line, TIGHT in the headroom, OOM past the card — or when
    the allocator simulation could not serve the step within the card (``allocator_oom``;
    ``None`` when it was not run, then the device total alone decides)."""
    usable = int(capacity * (1.0 - headroom))
    if allocator_oom or (allocator_oom is None and device_total > capacity):
        status = "oom"
    elif device_total > usable:
        status = "tight"
    else:
        status = "fits"
    return Verdict(
        gpu=gpu,
        capacity_bytes=capacity,
        headroom=headroom,
        status=status,
        compared_bytes=device_total,
        usable_bytes=usable,
    )
