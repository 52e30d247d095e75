"""System RAM for the run: the process, the model as loaded on the host, the DataLoader's
batches in flight, pinned staging buffers, and CPU-offloaded optimizer state.

    >>> from vramplan.analytic.calc import calculate
    >>> from vramplan.recipe import Recipe
    >>> estimate = calculate(20_000_000, 32, 1_000_000, Recipe(optimizer="adam"))
    >>> host_memory(estimate, HostOptions(workers=4)).terms["model_on_host"]  # fp32 weights
    80000000
"""

from __future__ import annotations

from dataclasses import dataclass

from vramplan.errors import UserError
from vramplan.result import Component, Estimate

# A CUDA PyTorch process holds its libraries (CUDA runtime, cuBLAS, cuDNN kernels for the
# host side) before any model: about 2 GiB of RSS is typical [H; measure with `measure`].
PROCESS_BYTES = 2 * 1024**3


@dataclass(frozen=True)
class HostOptions:
    """How the run feeds its GPU."""

    workers: int = 4
    prefetch_factor: int = 2
    pin_memory: bool = True
    offload_optimizer: bool = False
    limit_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.workers < 0 or self.prefetch_factor < 1:
            raise UserError("DataLoader workers must be >= 0 and prefetch factor >= 1")


@dataclass(frozen=True)
class HostMemory:
    """The host-side bill, term by term."""

    terms: dict[str, int]
    limit_bytes: int | None

    @property
    def total_bytes(self) -> int:
        return sum(self.terms.values())

    @property
    def exceeds_limit(self) -> bool:
        return self.limit_bytes is not None and self.total_bytes > self.limit_bytes

    def to_json(self) -> dict:
        return {
            "terms": dict(self.terms),
            "total_bytes": self.total_bytes,
            "limit_bytes": self.limit_bytes,
            "exceeds_limit": self.exceeds_limit,
        }


def host_memory(
    estimate: Estimate, options: HostOptions, state_bytes: int | None = None
) -> HostMemory:
    """Host RAM for ``estimate``'s run: batches in flight are workers × prefetch factor
    (the main process prefetches two when there are no workers), each pinned again when
    ``pin_memory`` is on; offloaded optimizer state lives on the host."""
    batch = estimate.details.get("input_bytes", estimate.components.get(Component.INPUTS, 0))
    in_flight = max(1, options.workers) * options.prefetch_factor
    terms = {
        "process": PROCESS_BYTES,
        "model_on_host": estimate.model.parameter_bytes + estimate.model.buffer_bytes,
        "dataloader_batches": in_flight * batch,
        "pinned_buffers": in_flight * batch if options.pin_memory else 0,
        "offloaded_optimizer_state": (state_bytes or 0) if options.offload_optimizer else 0,
        # Paged optimizer state and offloaded activations, as traced (trace/offdevice.py).
        **estimate.details.get("host_bytes", {}),
    }
    return HostMemory(terms, options.limit_bytes)
