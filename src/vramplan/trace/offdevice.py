"""Storages a step keeps off the card: paged optimizer state and offloaded activations.

They are traced like any other storage (so their lifetimes are known), then taken out of
the device's allocations; what remains is the most bytes of each kind alive at once, which
lives in host RAM::

    >>> from vramplan.trace.recorder import StorageRecord
    >>> a = StorageRecord(0, 1, 100, "forward", 1, "l1", "copy", 0, 2, {"offloaded"})
    >>> b = StorageRecord(1, 2, 300, "forward", 1, "l2", "copy", 1, 3, {"offloaded"})
    >>> host_peaks([a, b])
    {'offloaded_activations': 400}
"""

from __future__ import annotations

from collections.abc import Sequence

from vramplan.trace.recorder import StorageRecord

OFF_DEVICE = {
    "paged": "paged_optimizer_state",
    "offloaded": "offloaded_activations",
}
"""Recorder tag → the host-memory term it feeds."""


def off_device(record: StorageRecord) -> str | None:
    """The host term of a record kept off the card, or None for a device storage."""
    return next((OFF_DEVICE[t] for t in OFF_DEVICE if t in record.tags), None)


def host_peaks(records: Sequence[StorageRecord]) -> dict[str, int]:
    """For each host term, the most bytes of its storages alive at one event."""
    events: dict[str, list[tuple[int, int]]] = {}
    for record in records:
        term = off_device(record)
        if term is None:
            continue
        events.setdefault(term, []).append((record.alloc_index, record.nbytes))
        if record.free_index is not None:
            events[term].append((record.free_index, -record.nbytes))
    peaks = {}
    for term, deltas in events.items():
        live = peak = 0
        for _, delta in sorted(deltas):
            live += delta
            peak = max(peak, live)
        peaks[term] = peak
    return peaks
