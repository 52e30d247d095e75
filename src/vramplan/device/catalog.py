"""The GPU catalog: names, memory as the device reports it, architecture.

>>> lookup_gpu("a100").name
'A100-80GB'
>>> lookup_gpu("b200").compute_capability, lookup_gpu("b200").supports_bf16
((10, 0), True)
>>> lookup_gpu("t4").compute_capability, lookup_gpu("t4").supports_bf16
((7, 5), False)
>>> lookup_gpu("A100-40GB").total_bytes
42949672960
>>> gpu_from_memory("24GiB").total_bytes
25769803776
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

from vramplan.errors import UserError
from vramplan.trace.kernel_scratch import Card
from vramplan.units import parse_bytes

USUAL_MULTIPROCESSORS = {"sm70": 80, "sm75": 40, "sm80": 108, "sm86": 82, "sm89": 128}
USUAL_MULTIPROCESSORS |= {"sm90": 132, "sm100": 148, "sm120": 170}
"""A card given only by memory (``--gpu-memory``): the catalog's flagship of its
architecture (any other figure is as good a guess; the count moves few reductions)."""
THREADS_PER_MULTIPROCESSOR = {"sm75": 1024, "sm86": 1536, "sm89": 1536, "sm120": 1536}
"""CUDA's resident threads per multiprocessor where not 2048 (AMD's CDNA: 2048)."""


@dataclass(frozen=True)
class GpuSpec:
    """One card: its catalog name, total memory in bytes, and architecture."""

    name: str
    total_bytes: int
    arch: str = "sm80"
    family: str = "Ampere"
    vendor: str = "nvidia"
    aliases: tuple[str, ...] = ()
    multiprocessors: int | None = None
    """Streaming multiprocessors (compute units on AMD); None: the architecture's usual."""

    @property
    def compute_capability(self) -> tuple[int, int]:
        """(major, minor) as ``torch.cuda.get_device_capability`` reports it: "sm90" is
        (9, 0), "sm100" (10, 0), "sm120" (12, 0); on ROCm the gfx target's major and minor
        ("gfx90a" is (9, 0), "gfx942" (9, 4), "gfx1100" (11, 0))."""
        return compute_capability(self.arch)

    @property
    def supports_bf16(self) -> bool:
        """Whether the card has bf16 tensor-core math: NVIDIA from Ampere (sm80) on, and
        the AMD Instinct cards of the catalog (CDNA2 and later)."""
        if self.vendor == "amd":
            return True
        return self.compute_capability >= (8, 0)

    @property
    def kernel_card(self) -> Card:
        """What kernels' launch configurations read of this card (``kernel_scratch.py``):
        its multiprocessors, else its architecture's usual count, and threads per
        multiprocessor by architecture (1024 on Turing, 1536 on sm86/sm89/sm120).

        >>> lookup_gpu("l4").kernel_card
        Card(multiprocessors=58, threads_per_multiprocessor=1536, rocm=False)
        """
        threads = THREADS_PER_MULTIPROCESSOR.get(self.arch, 2048)
        count = self.multiprocessors or USUAL_MULTIPROCESSORS.get(self.arch, 108)
        return Card(count, threads, rocm=self.vendor == "amd")

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "total_bytes": self.total_bytes,
            "arch": self.arch,
            "compute_capability": list(self.compute_capability),
            "family": self.family,
            "vendor": self.vendor,
        }


def compute_capability(arch: str) -> tuple[int, int]:
    """(major, minor) of an architecture name: the last digit of "smXY" is the minor, the
    rest the major; a "gfxXYZ" target ends in a minor and a stepping digit (hex).

    >>> compute_capability("sm75"), compute_capability("sm100"), compute_capability("sm120")
    ((7, 5), (10, 0), (12, 0))
    >>> compute_capability("gfx90a"), compute_capability("gfx942"), compute_capability("gfx1100")
    ((9, 0), (9, 4), (11, 0))
    """
    sm = re.fullmatch(r"sm_?(\d+)(\d)", arch)
    if sm:
        return int(sm[1]), int(sm[2])
    gfx = re.fullmatch(r"gfx(\d+)([0-9a-f])([0-9a-f])", arch)
    if gfx:
        return int(gfx[1]), int(gfx[2], 16)
    raise ValueError(f"unknown GPU architecture {arch!r} (expected smXY or gfxXYZ)")


def _key(name: str) -> str:
    """Normalise a spelling: lower case, no spaces/underscores, no 'nvidia' or 'tesla'."""
    key = re.sub(r"[\s_]+", "-", name.strip().lower())
    for prefix in ("nvidia-", "tesla-", "geforce-", "amd-", "instinct-"):
        key = key.removeprefix(prefix)
    return key


@cache
def catalog() -> tuple[GpuSpec, ...]:
    """Every GPU in the bundled catalog (``data/gpus.json``)."""
    data = json.loads((resources.files("vramplan") / "data" / "gpus.json").read_text())
    return tuple(
        GpuSpec(
            name=g["name"],
            total_bytes=g["total_bytes"],
            arch=g["arch"],
            family=g["family"],
            vendor=g["vendor"],
            aliases=tuple(g["aliases"]),
            multiprocessors=g.get("multiprocessors"),
        )
        for g in data["gpus"]
    )


def lookup_gpu(name: str) -> GpuSpec:
    """The catalog GPU a common spelling names; a UserError lists close matches."""
    wanted = _key(name)
    spellings: dict[str, GpuSpec] = {}
    for gpu in catalog():
        spellings[_key(gpu.name)] = gpu
        for alias in gpu.aliases:
            spellings.setdefault(_key(alias), gpu)
    if wanted in spellings:
        return spellings[wanted]
    close = difflib.get_close_matches(wanted, list(spellings), n=4, cutoff=0.5)
    names = sorted({spellings[c].name for c in close})
    hint = f"; close matches: {', '.join(names)}" if names else "; see `vramplan gpus`"
    raise UserError(f"unknown GPU {name!r}{hint} (or give --gpu-memory 24GiB)")


MIN_GPU_BYTES = 256 * 1024**2
MAX_GPU_BYTES = 1024**5


def gpu_from_memory(size: str, arch: str = "sm80") -> GpuSpec:
    """An unnamed card with the given memory (``--gpu-memory 24GiB``)."""
    total = parse_bytes(size, "GPU memory", require_unit=True)
    if not MIN_GPU_BYTES <= total <= MAX_GPU_BYTES:
        raise UserError(
            f"GPU memory {size!r} is {total:,} bytes; give a card's size between 256MiB "
            "and 1PiB, such as 24GiB"
        )
    return GpuSpec(name=f"custom ({size})", total_bytes=total, arch=arch)
