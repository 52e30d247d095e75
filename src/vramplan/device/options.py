"""How to emulate the device: which card, the allocator settings, the margins, and a
measured profile — validated on construction.

    >>> device_options(gpu="a100-40gb", headroom=0.15).card.name
    'A100-40GB'
"""

from __future__ import annotations

from dataclasses import dataclass

from vramplan.device.alloc_conf import AllocatorConfig
from vramplan.device.catalog import GpuSpec, gpu_from_memory, lookup_gpu
from vramplan.device.measured import MeasuredTable, measured_for
from vramplan.device.profile import DeviceProfile, load_profile, profile_for
from vramplan.device.runtime import COUNTERS
from vramplan.device.stack import Stack, default_stack, parse_stack
from vramplan.errors import UserError

DEFAULT_GPU = "A100-80GB"


@dataclass(frozen=True)
class DeviceOptions:
    """How to emulate the device: which card, the allocator settings, the margins."""

    gpu: GpuSpec | None = None
    headroom: float = 0.10
    alloc_conf: str | None = None
    cudnn_benchmark: bool = False
    data_parallel: int = 1
    profile: DeviceProfile | None = None
    """Measured runtime figures (``vramplan calibrate``) that replace the table's."""
    stack: Stack | None = None
    """The PyTorch + CUDA stack emulated (``None``: the installed torch)."""
    used_counter: str = "nvml-v1"
    """Which 'used' figure the device total matches: ``nvml-v1`` counts the driver's
    reserved framebuffer, ``nvml-v2`` does not (``data/runtime.json`` used_counters)."""
    measured: MeasuredTable | None = None
    """A GPU harvest's table for this card and stack (``device/measured.py``)."""

    def __post_init__(self) -> None:
        if self.used_counter not in COUNTERS:
            raise UserError(
                f"unknown used counter {self.used_counter!r}; choose {' or '.join(COUNTERS)}"
            )
        if not 0.0 <= self.headroom < 1.0:
            raise UserError(f"headroom must be a fraction in [0, 1), got {self.headroom}")
        if self.data_parallel < 1:
            raise UserError(f"data-parallel degree must be at least 1, got {self.data_parallel}")
        AllocatorConfig.parse(self.alloc_conf)  # fail early on a malformed conf

    @property
    def card(self) -> GpuSpec:
        """The card to emulate: the chosen one, or the default architecture."""
        return self.gpu or lookup_gpu(DEFAULT_GPU)

    @property
    def software(self) -> Stack:
        """The stack emulated: the chosen one or the installed torch's."""
        return self.stack or default_stack()


def device_options(
    gpu: str | None = None,
    gpu_memory: str | None = None,
    headroom: float = 0.10,
    alloc_conf: str | None = None,
    cudnn_benchmark: bool = False,
    data_parallel: int = 1,
    profile: str | None = None,
    stack: str | None = None,
    used_counter: str = "nvml-v1",
) -> DeviceOptions:
    """Validated device options from names (``gpu="a100"`` or ``gpu_memory="24GiB"``); a
    profile path, or the saved profile of the named card, supplies measured runtime figures."""
    if gpu is not None and gpu_memory is not None:
        raise UserError("give either --gpu or --gpu-memory, not both")
    if gpu is not None and not str(gpu).strip():
        raise UserError("--gpu is empty: name a card (see `vramplan gpus`) or leave the flag out")
    if gpu_memory is not None and not str(gpu_memory).strip():
        raise UserError("--gpu-memory is empty: give a size such as 24GiB or leave the flag out")
    card = lookup_gpu(gpu) if gpu else gpu_from_memory(gpu_memory) if gpu_memory else None
    calibrated = load_profile(profile) if profile else profile_for(card.name) if gpu else None
    software = parse_stack(stack) if stack else default_stack()
    table = measured_for(card.name, software.slug) if card is not None else None
    return DeviceOptions(
        gpu=card,
        headroom=headroom,
        alloc_conf=alloc_conf,
        cudnn_benchmark=cudnn_benchmark,
        data_parallel=data_parallel,
        profile=calibrated,
        stack=software,
        used_counter=used_counter,
        measured=table,
    )
