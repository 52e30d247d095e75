"""Attribute a window of the CUDA caching allocator's trace (pure, no torch): what a call
allocated and freed before returning (its workspaces), what it left live (its outputs), the
segments it opened, and whether it released cached segments (``empty_cache``, which cuDNN's
benchmark search calls).

The events are ``torch.cuda.memory._snapshot()["device_traces"][device]`` entries, recorded
with ``torch.cuda.memory._record_memory_history()`` around the call: dicts with ``action``,
``addr``, ``size``, ``stream`` (``frames`` optional). ``alloc`` sizes are the sizes asked
for, before the allocator's 512-byte rounding::

    >>> events = [
    ...     {"action": "segment_alloc", "addr": 0x1000, "size": 2097152, "stream": 0},
    ...     {"action": "alloc", "addr": 0x1000, "size": 4096, "stream": 0},
    ...     {"action": "alloc", "addr": 0x2000, "size": 512, "stream": 0},
    ...     {"action": "free_requested", "addr": 0x1000, "size": 4096, "stream": 0},
    ...     {"action": "free_completed", "addr": 0x1000, "size": 4096, "stream": 0},
    ... ]
    >>> window = attribute(events)
    >>> window.workspace_bytes, window.live_bytes, window.segment_bytes
    (4096, 512, 2097152)
"""

from __future__ import annotations

from dataclasses import dataclass

# Actions that hand cached memory back to CUDA. PyTorch records ``empty_cache()`` as one
# ``segment_free`` per released segment (``segment_unmap`` with expandable segments); a
# literal ``empty_cache`` action is accepted too, should a release name it.
RELEASE_ACTIONS = frozenset({"segment_free", "segment_unmap", "empty_cache"})
GROW_ACTIONS = frozenset({"segment_alloc", "segment_map"})


@dataclass(frozen=True)
class Window:
    """What happened in the allocator during one call.

    ``transient``: (addr, size) of allocations made and freed inside the window, largest
    first. ``live``: (addr, size) of allocations made inside and still live at its end.
    ``freed_earlier_bytes``: frees of blocks allocated before the window.
    """

    transient: tuple[tuple[int, int], ...]
    live: tuple[tuple[int, int], ...]
    segment_bytes: int
    released_bytes: int
    cache_emptied: bool
    oom: bool
    freed_earlier_bytes: int
    events: int

    @property
    def workspace_bytes(self) -> int:
        """The largest allocation freed before the call returned (0 when none)."""
        return self.transient[0][1] if self.transient else 0

    @property
    def live_bytes(self) -> int:
        return sum(size for _, size in self.live)

    def live_except(self, addresses) -> list[int]:
        """Sizes of live allocations not at ``addresses`` (e.g. not the call's outputs)."""
        skip = set(addresses)
        return [size for addr, size in self.live if addr not in skip]

    def to_json(self, top: int = 8) -> dict:
        return {
            "workspace_bytes": self.workspace_bytes,
            "transient_bytes": [size for _, size in self.transient[:top]],
            "transient_count": len(self.transient),
            "live_bytes": [size for _, size in self.live[:top]],
            "segment_bytes": self.segment_bytes,
            "released_bytes": self.released_bytes,
            "cache_emptied": self.cache_emptied,
            "oom": self.oom,
            "freed_earlier_bytes": self.freed_earlier_bytes,
            "events": self.events,
        }


def attribute(events: list[dict], start: int = 0, end: int | None = None) -> Window:
    """Attribute ``events[start:end]`` (a whole trace recorded around one call by default)."""
    window = events[start:end]
    open_blocks: dict[int, int] = {}  # addr -> size, allocated inside the window
    transient: list[tuple[int, int]] = []
    grown = released = freed_earlier = 0
    emptied = oom = False
    for event in window:
        action = event.get("action")
        if action == "alloc":
            open_blocks[event["addr"]] = int(event["size"])
        elif action == "free_requested":
            size = open_blocks.pop(event["addr"], None)
            if size is None:
                freed_earlier += int(event.get("size", 0))
            else:
                transient.append((event["addr"], size))
        elif action in GROW_ACTIONS:
            grown += int(event.get("size", 0))
        elif action in RELEASE_ACTIONS:
            released += int(event.get("size", 0))
            emptied = True
        elif action == "oom":
            oom = True
    return Window(
        transient=tuple(sorted(transient, key=lambda item: -item[1])),
        live=tuple(sorted(open_blocks.items(), key=lambda item: -item[1])),
        segment_bytes=grown,
        released_bytes=released,
        cache_emptied=emptied,
        oom=oom,
        freed_earlier_bytes=freed_earlier,
        events=len(window),
    )


def device_events(snapshot: dict, device: int) -> list[dict]:
    """The trace of one device from a ``_snapshot()`` dict (empty when none was recorded)."""
    traces = snapshot.get("device_traces") or []
    return list(traces[device]) if device < len(traces) else []
