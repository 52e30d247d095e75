"""Record the caching allocator around one call (needs a GPU): the call's trace window from
``torch.cuda.memory._record_memory_history`` / ``_snapshot()``, attributed by
``snapshot.attribute``, with the peak reserved and allocated growth of the call::

    result, facts = record_call(lambda: torch.mm(a, b))
    facts["window"].workspace_bytes, facts["peak_reserved_growth"]
"""

from __future__ import annotations

import time

import torch

from benchmarks.gpu_harvest.snapshot import attribute, device_events

MAX_ENTRIES = 100_000


def _start(frames: bool) -> None:
    kwargs = {"context": "alloc", "stacks": "all"} if frames else {"context": None}
    try:
        torch.cuda.memory._record_memory_history(
            "all", max_entries=MAX_ENTRIES, clear_history=True, **kwargs
        )
    except TypeError:  # an older PyTorch without clear_history
        torch.cuda.memory._record_memory_history("all", max_entries=MAX_ENTRIES, **kwargs)


def _stop() -> None:
    torch.cuda.memory._record_memory_history(enabled=None)


def record_call(call, frames: bool = False):
    """``call()`` with the allocator's history recorded: (its result or None on OOM, facts).
    ``facts``: ``window`` (a snapshot.Window), ``events`` (the raw window, with frames when
    asked), ``peak_reserved_growth``, ``peak_allocated_growth``, ``oom``, ``seconds``,
    ``wrapped`` (the ring buffer overflowed: the window is incomplete)."""
    device = torch.cuda.current_device()
    torch.cuda.synchronize()
    reserved_before = torch.cuda.memory_reserved()
    allocated_before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _start(frames)
    first = len(device_events(torch.cuda.memory._snapshot(), device))
    result, oom = None, None
    start = time.perf_counter()
    try:
        result = call()
        torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError as exc:
        oom = str(exc).splitlines()[0][:300]
    finally:
        seconds = time.perf_counter() - start
        events = device_events(torch.cuda.memory._snapshot(), device)[first:]
        _stop()
    if oom:
        torch.cuda.empty_cache()
    return result, {
        "window": attribute(events),
        "events": events,
        "reserved_before": int(reserved_before),
        "peak_reserved_growth": int(torch.cuda.max_memory_reserved() - reserved_before),
        "peak_allocated_growth": int(torch.cuda.max_memory_allocated() - allocated_before),
        "oom": oom,
        "seconds": round(seconds, 4),
        "wrapped": first + len(events) >= MAX_ENTRIES,
    }
