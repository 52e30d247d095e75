"""Is memory still growing after the optimizer state exists? A leak check over steps.

>>> check_leak((100, 180, 180, 180)).leaking
False
>>> check_leak((100_000, 180_000, 260_000, 340_000)).leaking
True
"""

from __future__ import annotations

from dataclasses import dataclass

# Growth below this per step is allocator noise (a few scalars), not a leak.
TOLERANCE_BYTES = 4096


@dataclass(frozen=True)
class LeakReport:
    """Memory after each step and what its growth says."""

    after_step_bytes: tuple[int, ...]
    growth_per_step: tuple[int, ...]
    leaking: bool

    @property
    def bytes_per_step(self) -> int:
        return self.growth_per_step[-1] if self.growth_per_step else 0

    def to_json(self) -> dict:
        return {
            "after_step_bytes": list(self.after_step_bytes),
            "growth_per_step": list(self.growth_per_step),
            "leaking": self.leaking,
            "bytes_per_step": self.bytes_per_step,
        }


def check_leak(after_step_bytes: tuple[int, ...]) -> LeakReport:
    """Flag a leak when live memory grows after every step from the second one on (the
    first step creates the optimizer state, so it may grow legitimately). Needs at least
    three steps to judge."""
    growth = tuple(b - a for a, b in zip(after_step_bytes, after_step_bytes[1:], strict=False))
    judged = growth[1:] if len(growth) > 1 else ()
    leaking = bool(judged) and all(g > TOLERANCE_BYTES for g in judged)
    return LeakReport(tuple(after_step_bytes), growth, leaking)
