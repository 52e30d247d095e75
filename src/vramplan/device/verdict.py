"""The verdict: does the step fit a card once a headroom margin is kept free?

>>> judge("T4", 16 * 2**30, 0.10, 15 * 2**30).status
'tight'
"""

from __future__ import annotations

from vramplan.result import Verdict


def judge(
    gpu: str,
    capacity: int,
    headroom: float,
    device_total: int,
    allocator_oom: bool | None = None,
    high: int | None = None,
) -> Verdict:
    """FITS when the high end of the range (``high``; the device total when not given)
    is under the headroom line, TIGHT when the central figure or the high end is in the
    headroom (or past the card), OOM when the central figure is past the card — or when the
    allocator simulation could not serve the step within the card (``allocator_oom``;
    ``None`` when it was not run, then the device total alone decides). ``capacity`` is
    what the job can use: the card less the driver's reserve. ``compared_bytes`` is the
    figure read: the high end; ``central_bytes`` the central one."""
    usable = int(capacity * (1.0 - headroom))
    high = device_total if high is None else max(high, device_total)
    if allocator_oom or (allocator_oom is None and device_total > capacity):
        status = "oom"
    elif high > usable:
        status = "tight"
    else:
        status = "fits"
    return Verdict(
        gpu=gpu,
        capacity_bytes=capacity,
        headroom=headroom,
        status=status,
        compared_bytes=high,
        usable_bytes=usable,
        central_bytes=device_total,
    )
