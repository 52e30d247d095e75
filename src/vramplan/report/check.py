"""``vramplan check``: one line and an exit code a launcher or a CI job can act on.

>>> check_exit_code("fits"), check_exit_code("tight"), check_exit_code("oom")
(0, 3, 3)
"""

from __future__ import annotations

from typing import Any

from vramplan.result import Estimate
from vramplan.units import format_bytes

SCHEMA = "vramplan.check/1"
EXIT_DOES_NOT_FIT = 3


def check_exit_code(status: str) -> int:
    """0 when the step fits with the headroom kept free; 3 when it is tight (inside the
    headroom) or out of memory."""
    return 0 if status == "fits" else EXIT_DOES_NOT_FIT


def check_line(estimate: Estimate, units: str = "binary") -> str:
    """``FITS: hf:gpt2 (batch 8, amp-bf16) needs 3.1 GiB of 13.1 GiB usable on T4 ...``."""
    verdict = estimate.verdict
    recipe = estimate.recipe
    fmt = lambda n: format_bytes(n, units)  # noqa: E731
    what = f"{estimate.model.name} (batch {recipe.batch_size}"
    if recipe.seq_len:
        what += f", seq {recipe.seq_len}"
    what += f", {recipe.precision})"
    parallel = estimate.details.get("parallel")
    if parallel:
        what += f" [{parallel['layout']}]"
    needs = (
        f"needs {fmt(verdict.compared_bytes)} of {fmt(verdict.usable_bytes)} usable "
        f"on {verdict.gpu}"
    )
    if verdict.status == "fits":
        tail = f"{fmt(verdict.spare_bytes)} to spare"
    elif verdict.status == "tight":
        tail = (
            f"inside the {verdict.headroom:.0%} headroom "
            f"(the card holds {fmt(verdict.capacity_bytes)})"
        )
    else:
        tail = f"more than the card's {fmt(verdict.capacity_bytes)}"
    return f"{verdict.status.upper()}: {what} {needs}, {tail}"


def check_json(estimate: Estimate, config: tuple[str, ...] = ()) -> dict[str, Any]:
    """The answer as a ``vramplan.check/1`` object."""
    verdict = estimate.verdict
    data = {
        "schema": SCHEMA,
        "fits": verdict.status == "fits",
        "status": verdict.status,
        "exit_code": check_exit_code(verdict.status),
        "model": estimate.model.name,
        "recipe": estimate.recipe.to_json(),
        "device_total_bytes": estimate.peak.device_total_bytes,
        "verdict": verdict.to_json(),
    }
    if config:
        data["config"] = list(config)
    return data
