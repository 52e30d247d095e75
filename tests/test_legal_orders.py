"""The step's other legal orders (``device.orders``): more steady-state iterations, and the
optimizer state created one step late (a GradScaler-skipped first step), replayed
through the allocator for the high side of the fragmentation term."""

from __future__ import annotations

from vramplan.device.allocator import AllocatorConfig, Replay, replay
from vramplan.device.orders import LegalOrders, legal_orders, requests_in_order, segments
from vramplan.device.replay import DeviceTrace, requests_of
from vramplan.pipeline import traced
from vramplan.recipe import Recipe
from vramplan.sources import resolve
from vramplan.trace.events import Allocation, PhaseMark, Trace
from vramplan.trace.policy import CudaPolicy

MiB = 2**20


def _alloc(id_, mib, phase, iteration, at, free=None):
    return Allocation(id_, mib * MiB, "activations", phase, iteration, "", "op", at, free)


def _step_trace() -> DeviceTrace:
    """Two iterations of a set_to_none step: parameter P; forward A, backward makes the
    gradient G and frees A; the optimizer makes its state S and a temporary T, and
    zero_grad frees G."""
    allocations = (
        _alloc(0, 12, "setup", 0, 0),  # P
        _alloc(1, 30, "forward", 1, 1, free=3),  # A1
        _alloc(2, 12, "backward", 1, 2, free=6),  # G1, freed by zero_grad
        _alloc(3, 24, "optimizer", 1, 4),  # S, kept
        _alloc(4, 14, "optimizer", 1, 5, free=7),  # T1
        _alloc(5, 30, "forward", 2, 8, free=10),  # A2
        _alloc(6, 12, "backward", 2, 9, free=13),  # G2
        _alloc(7, 14, "optimizer", 2, 11, free=12),  # T2
    )
    phases = (
        PhaseMark(0, "setup", 0),
        PhaseMark(1, "forward", 1),
        PhaseMark(2, "backward", 1),
        PhaseMark(4, "optimizer", 1),
        PhaseMark(8, "forward", 2),
        PhaseMark(9, "backward", 2),
        PhaseMark(11, "optimizer", 2),
    )
    return DeviceTrace(Trace(allocations, phases, 14))


def _sequence(requests):
    return [(r.size // MiB, "+" if r.is_alloc else "-") for r in requests]


def test_segments_follow_iteration_and_phase():
    cut = segments(_step_trace())
    assert [(i, str(p), len(e)) for i, p, e in cut] == [
        (0, "setup", 1),
        (1, "forward", 1),
        (1, "backward", 2),
        (1, "optimizer", 4),
        (2, "forward", 1),
        (2, "backward", 2),
        (2, "optimizer", 3),
    ]


def test_state_late_keeps_zero_grad_in_place_and_moves_the_state_after_a_second_pass():
    """The skipped first step still frees G1 (zero_grad); the state and the step's
    temporary come after the repeated forward and backward, and that pass's gradient is
    freed by the last step's zero_grad before the traced second iteration runs."""
    orders = legal_orders(_step_trace(), late_state=True)
    assert _sequence(orders.state_late) == [
        (12, "+"),  # P
        (30, "+"),  # A1
        (12, "+"),  # G1
        (30, "-"),
        (12, "-"),  # zero_grad of the skipped step
        (30, "+"),  # A2, repeated
        (12, "+"),
        (30, "-"),
        (24, "+"),  # S, one step late
        (14, "+"),
        (14, "-"),
        (12, "-"),  # zero_grad after the first real step
        (30, "+"),  # the traced second iteration
        (12, "+"),
        (30, "-"),
        (14, "+"),
        (14, "-"),
        (12, "-"),
    ]


def test_more_iterations_repeat_the_last_iteration_with_fresh_keys_after_the_step():
    step = _step_trace()
    orders = legal_orders(step, late_state=False)
    assert orders.state_late == []
    base = requests_of(step)
    extra = orders.more_iterations
    assert _sequence(extra) == _sequence(base)[-6:] * 2
    assert {r.key for r in extra if r.is_alloc}.isdisjoint(r.key for r in base)
    assert len({r.key for r in extra if r.is_alloc}) == sum(r.is_alloc for r in extra)
    config = AllocatorConfig()
    assert (
        replay(base + extra, config).stats.peak_reserved == replay(base, config).stats.peak_reserved
    )


def test_more_iterations_fed_on_equal_the_longer_run_replayed_whole(tiny_gpt2_config):
    """The continuation of a real traced step gives what replaying the whole longer run
    (its events with the last iteration twice more, keyed afresh) gives."""
    recipe = Recipe(batch_size=2, seq_len=32, precision="amp-bf16")
    built = resolve(f"hf:{tiny_gpt2_config}", recipe)
    step = DeviceTrace(traced(built, recipe, CudaPolicy()))
    parts = segments(step)
    final = [p for p in parts if p[0] == max(i for i, _, _ in parts)]
    whole = requests_in_order(step, [e for _, _, events in parts + final + final for e in events])
    config = AllocatorConfig()
    fed_on = Replay(config)
    fed_on.run(requests_of(step))
    continued = fed_on.run(legal_orders(step, late_state=False).more_iterations)
    replayed = replay(whole, config)
    assert continued.stats == replayed.stats
    assert continued.stats.peak_reserved > 0


def test_a_single_iteration_has_no_other_order():
    one = Trace((_alloc(0, 12, "forward", 1, 0, free=1),), (PhaseMark(0, "forward", 1),), 2)
    assert legal_orders(DeviceTrace(one), late_state=True) == LegalOrders()
