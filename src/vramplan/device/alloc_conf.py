"""``PYTORCH_CUDA_ALLOC_CONF``: the settings of PyTorch's caching allocator that change
memory use, read from its ``key:value,key:value`` syntax.

    >>> AllocatorConfig.parse("expandable_segments:True").expandable_segments
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from vramplan.errors import UserError

MB = 1024 * 1024
LARGE_BUFFER = 20 * MB
ROUNDUP_INTERVALS = 16
UNLIMITED = 2**63


def is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


@dataclass(frozen=True)
class AllocatorConfig:
    """The settings of ``PYTORCH_CUDA_ALLOC_CONF`` that change memory use.

    >>> AllocatorConfig.parse("max_split_size_mb:128,expandable_segments:True").max_split_size
    134217728
    """

    max_split_size: int = UNLIMITED
    max_non_split_rounding: int = LARGE_BUFFER
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    expandable_segments: bool = False
    garbage_collection_threshold: float = 0.0
    backend: str = "native"

    @classmethod
    def parse(cls, text: str | None) -> AllocatorConfig:
        """Read the ``key:value,key:value`` syntax of ``PYTORCH_CUDA_ALLOC_CONF``."""
        if not text or not text.strip():
            return cls()
        values: dict = {}
        for key, value in _split_options(text):
            if key == "max_split_size_mb":
                mb = _number(key, value)
                if mb < LARGE_BUFFER // MB:
                    raise UserError(
                        f"alloc conf: max_split_size_mb must be at least 20, got {value}"
                    )
                values["max_split_size"] = int(mb * MB)
            elif key == "max_non_split_rounding_mb":
                values["max_non_split_rounding"] = int(_number(key, value) * MB)
            elif key == "roundup_power2_divisions":
                values["roundup_power2_divisions"] = _parse_divisions(value)
            elif key == "expandable_segments":
                values["expandable_segments"] = _boolean(key, value)
            elif key == "garbage_collection_threshold":
                threshold = _number(key, value)
                if not 0.0 < threshold < 1.0:
                    raise UserError(
                        f"alloc conf: garbage_collection_threshold must be in (0, 1), got {value}"
                    )
                values["garbage_collection_threshold"] = threshold
            elif key == "backend":
                if value not in ("native", "cudaMallocAsync"):
                    raise UserError(
                        f"alloc conf: backend must be native or cudaMallocAsync, got {value}"
                    )
                values["backend"] = value
            elif key in (
                "release_lock_on_cudamalloc",
                "pinned_use_cuda_host_register",
                "pinned_num_register_threads",
                "pinned_use_background_threads",
            ):
                continue  # no effect on device memory
            else:
                raise UserError(f"alloc conf: unknown option {key!r}")
        return cls(**values)

    @cached_property
    def rounds_to_divisions(self) -> bool:
        """Whether any size rounds to power-of-two divisions (else to 512 bytes)."""
        return any(d > 1 for d in self.roundup_power2_divisions)

    def divisions_for(self, size: int) -> int:
        """The power-of-two divisions that apply to a request of ``size`` bytes."""
        index = max(0, size.bit_length() - 1 - 20)
        return self.roundup_power2_divisions[min(index, ROUNDUP_INTERVALS - 1)]


def _split_options(text: str) -> list[tuple[str, str]]:
    """Split on commas outside brackets, then on the first colon."""
    parts, depth, current = [], 0, ""
    for char in text.strip():
        depth += char == "["
        depth -= char == "]"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    pairs = []
    for part in parts:
        key, sep, value = part.strip().partition(":")
        if not sep or not key.strip() or not value.strip():
            raise UserError(f"alloc conf: cannot read {part.strip()!r}; use key:value pairs")
        pairs.append((key.strip(), value.strip()))
    return pairs


def _number(key: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise UserError(f"alloc conf: {key} needs a number, got {value!r}") from None


def _boolean(key: str, value: str) -> bool:
    if value in ("True", "true", "1"):
        return True
    if value in ("False", "false", "0"):
        return False
    raise UserError(f"alloc conf: {key} needs True or False, got {value!r}")


def _division(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise UserError(
            f"alloc conf: roundup_power2_divisions needs integers, got {value!r}"
        ) from None
    if number != 0 and not is_power_of_two(number):
        raise UserError(
            f"alloc conf: roundup_power2_divisions must be 0 or a power of 2, got {number}"
        )
    return number


def _parse_divisions(value: str) -> tuple[int, ...]:
    """A single value for every interval, or ``[256:1,512:2,>:8]`` keyed by MB sizes."""
    if not value.startswith("["):
        return (_division(value),) * ROUNDUP_INTERVALS
    if not value.endswith("]"):
        raise UserError(f"alloc conf: unterminated list in roundup_power2_divisions {value!r}")
    slots = [0] * ROUNDUP_INTERVALS
    last_index, first = 0, True
    for item in value[1:-1].split(","):
        key, sep, number = item.strip().partition(":")
        if not sep:
            raise UserError(f"alloc conf: cannot read {item!r} in roundup_power2_divisions")
        divisions = _division(number.strip())
        if key.strip() == ">":
            for index in range(last_index + 1, ROUNDUP_INTERVALS):
                slots[index] = divisions
            continue
        megabytes = int(_number("roundup_power2_divisions", key))
        if not is_power_of_two(megabytes):
            raise UserError(
                f"alloc conf: roundup_power2_divisions sizes must be powers of 2, got {key}"
            )
        index = min(megabytes.bit_length() - 1, ROUNDUP_INTERVALS - 1)
        if first:
            for lower in range(index):
                slots[lower] = divisions
            first = False
        slots[index] = divisions
        last_index = index
    return tuple(slots)
