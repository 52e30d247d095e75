"""Other legal orders of the traced step: what a real run may do that the two traced
iterations do not show, replayed through the same allocator to bound the reserved peak.

The trace holds two iterations; a real run holds many, and the caching allocator never
returns a segment on its own, so the reserved figure read after a run is the highest any
iteration reached. Two orders a real run may take:

- ``more_iterations``: the last traced iteration repeated twice more (a cache that is
  still settling grows here; one at its steady state does not);
- ``state_late``: the optimizer state created one step late. ``torch.amp.GradScaler``
  skips ``optimizer.step()`` when the scaled gradients overflow (its ``_maybe_opt_step``
  steps only when ``found_inf`` sums to zero), which fp16 runs do in their first steps
  while the initial scale of 2**16 backs off (PyTorch's AMP docs, "Gradient Scaling");
  ``zero_grad`` still runs. Optimizers create their state lazily in the first step that
  runs, so the state then lands in a cache already shaped by a second forward and
  backward.

Each order is a list of allocator requests; an allocation replayed twice gets a fresh key
per instance, and a free releases the latest one. ``more_iterations`` begins as the step
does, so it is given as what follows the step's own requests (``replay.requests_of``), to
feed the replay that took them (``allocator.Replay``) rather than replay the step again::

    orders = legal_orders(device_trace, late_state=True)
    orders.more_iterations  # the requests after the step's own
    orders.state_late       # a whole order ([] where it does not apply)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from vramplan.device.allocator import Request
from vramplan.result import Phase
from vramplan.trace.events import Event

Segment = tuple[int, Phase, tuple[Event, ...]]
"""A run of events in one (iteration, phase)."""


def segments(on_device) -> list[Segment]:
    """The events of a ``DeviceTrace`` cut where the (iteration, phase) changes."""
    trace = on_device.trace
    marks = sorted(trace.phases, key=lambda m: m.index)
    cut: list[tuple[int, Phase, list[Event]]] = []
    position = 0
    for event in on_device.events:
        while position + 1 < len(marks) and marks[position + 1].index <= event.index:
            position += 1
        mark = marks[position]
        if not cut or (cut[-1][0], cut[-1][1]) != (mark.iteration, mark.phase):
            cut.append((mark.iteration, mark.phase, []))
        cut[-1][2].append(event)
    return [(iteration, phase, tuple(events)) for iteration, phase, events in cut]


def requests_in_order(
    on_device, events: Iterable[Event], live: dict[int, int] | None = None, first_key: int = 0
) -> list[Request]:
    """Allocator requests for ``events`` (which may repeat a segment): each allocation
    event opens a fresh instance (keys from ``first_key``); a free releases the latest live
    instance of its allocation, and frees of nothing live are dropped. ``live``: the
    instances already live (allocation id: key), when the requests follow others."""
    keys = itertools.count(first_key)
    live = dict(live or {})
    requests = []
    for event in events:
        a = event.allocation
        if a.id in on_device.empty_cache:
            requests.append(Request(next(keys), 0, False, a.stream, empty_cache=True))
        elif event.is_alloc:
            if a.id in live:  # the earlier instance of a repeated segment was never freed
                requests.append(Request(live.pop(a.id), a.nbytes, False, a.stream))
            live[a.id] = next(keys)
            requests.append(
                Request(
                    live[a.id],
                    a.nbytes,
                    True,
                    a.stream,
                    candidates=on_device.candidates.get(a.id, ()),
                    fallbacks=on_device.fallbacks.get(a.id, ()),
                )
            )
        elif a.id in live:
            requests.append(Request(live.pop(a.id), a.nbytes, False, a.stream))
    return requests


def _events(parts: Iterable[Segment]) -> list[Event]:
    return [event for _, _, events in parts for event in events]


@dataclass(frozen=True)
class LegalOrders:
    """The step's other legal orders: ``more_iterations`` as the requests that follow the
    step's own (keys above its allocation ids), ``state_late`` whole ([]: none)."""

    more_iterations: list[Request] = field(default_factory=list)
    state_late: list[Request] = field(default_factory=list)


def legal_orders(on_device, late_state: bool) -> LegalOrders:
    """The alternative orders of a trained step (none for inference or one iteration):
    the last iteration twice more, always, following the step's own requests (which
    ``replay.requests_of`` keys by allocation id: what is still alive at the step's end is
    freed where its next instance is made); the state created one step late when
    ``late_state`` (fp16 with a GradScaler) and the first iteration stepped an optimizer."""
    parts = segments(on_device)
    last = max((iteration for iteration, _, _ in parts), default=0)
    if last < 2 or not any(phase == Phase.BACKWARD for _, phase, _ in parts):
        return LegalOrders()
    final = [p for p in parts if p[0] == last]
    allocations = on_device.trace.allocations
    alive = {a.id: a.id for a in allocations if a.free_index is None}
    first_key = 1 + max((a.id for a in allocations), default=-1)
    more = requests_in_order(on_device, _events(final + final), alive, first_key)
    steps = {i: [p for p in parts if p[0] == i and p[1] == Phase.OPTIMIZER] for i in (1, last)}
    if not (late_state and steps[1]):
        return LegalOrders(more)
    step, zero_grad = _split_step(steps[1])
    _, zero_grad_last = _split_step(steps[last])
    before = [p for p in parts if p[0] < 1 or (p[0] == 1 and p[1] != Phase.OPTIMIZER)]
    again = [p for p in final if p[1] != Phase.OPTIMIZER]
    rest = [p for p in parts if p[0] >= 2]
    order = _events(before) + zero_grad + _events(again) + step + zero_grad_last
    return LegalOrders(more, requests_in_order(on_device, order + _events(rest)))


def _split_step(step: list[Segment]) -> tuple[list[Event], list[Event]]:
    """An optimizer segment's own allocations and their frees (the state, the step's
    temporaries), and the rest: ``zero_grad`` freeing gradients made before it."""
    events = _events(step)
    made = {e.allocation.id for e in events if e.is_alloc}
    return [e for e in events if e.allocation.id in made], [
        e for e in events if e.allocation.id not in made
    ]
