"""transformers' quantized KV cache (``QuantizedCache``, transformers 5.23
``cache_utils.py``), its storage modelled without the backend libraries.

``QuantizedLayer.update`` (transformers' own code, run as is) keeps up to
``residual_length`` tokens in full precision and the rest quantized: the prefill
quantizes the prompt; each decode step dequantizes the quantized part, concatenates it
with the residual and the new token (the keys and values attention reads), and once the
residual is full quantizes the whole concatenation again and empties the residual. The
backends store (``_quantize``):

- **quanto** (optimum-quanto 0.2, ``MaxOptimizer`` + ``quantize_weight``; a 4-D tensor is
  never an AWQ or TinyGemm tensor): the values packed ``8 / nbits`` to a uint8
  (``PackedTensor``), a scale and a shift per group of ``q_group_size`` elements in the
  cache's dtype (``tensor/grouped.py``: groups over the flattened tensor, axis 0).
- **hqq** (hqq 0.2, ``Quantizer.quantize``): the values bit-packed (uint8 for 1, 2, 4 and 8
  bits; 3 bits ten to an int32), a scale and a zero per group in the compute dtype.
- **fp8** (``Fp8QuantizedLayer``): float8_e4m3 values and one fp32 scale per tensor,
  grown by ``torch.cat`` with no residual (run as transformers writes it).

The backends' own temporaries while they quantize (min/max, rounding, hqq's optimiser)
are not modelled.

>>> KvQuantization("quanto").stored_bytes((1, 8, 128, 128), torch.bfloat16)  # 64 KiB + groups
73728
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vramplan.errors import UserError

BACKENDS = ("quanto", "hqq", "fp8")
BITS = {"quanto": (2, 4), "hqq": (1, 2, 3, 4, 8)}
DEFAULTS = {"nbits": 4, "q_group_size": 64, "residual_length": 128}
"""transformers' ``QuantizedLayer`` defaults."""


@dataclass(frozen=True)
class KvQuantization:
    """A quantized KV cache: ``backend`` and (quanto, hqq) bits, group and residual.

    >>> KvQuantization("hqq", nbits=2).bytes_per_element(torch.float16)
    0.3125
    """

    backend: str
    nbits: int = DEFAULTS["nbits"]
    q_group_size: int = DEFAULTS["q_group_size"]
    residual_length: int = DEFAULTS["residual_length"]

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise UserError(f"unknown KV cache backend {self.backend!r}; choose quanto, hqq, fp8")
        if self.backend == "fp8":
            return
        if self.nbits not in BITS[self.backend]:
            allowed = ", ".join(str(b) for b in BITS[self.backend])
            raise UserError(f"--kv-bits {self.nbits}: the {self.backend} cache takes {allowed}")
        for name in ("q_group_size", "residual_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise UserError(f"--kv-{name.replace('_', '-')} must be a positive integer")

    def layout(self, shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple[tuple, torch.dtype]]:
        """(shape, dtype) of each tensor that holds one quantized tensor of ``shape``."""
        numel = 1
        for size in shape:
            numel *= size
        if self.backend == "fp8":
            return [(tuple(shape), torch.float8_e4m3fn), ((), torch.float32)]
        per_row = numel // shape[0]
        if per_row % self.q_group_size:
            raise UserError(
                f"--kv-group-size {self.q_group_size} does not divide a cached tensor's "
                f"{per_row} elements per sequence"
            )
        groups = numel // self.q_group_size
        if self.backend == "hqq" and self.nbits == 3:
            packed = ((-(-groups // 10), self.q_group_size), torch.int32)
        else:
            per_byte = 8 // self.nbits
            packed = ((-(-groups // per_byte), self.q_group_size), torch.uint8)
        return [packed, ((groups, 1), dtype), ((groups, 1), dtype)]

    def stored_bytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Bytes of one quantized tensor of ``shape`` (cache dtype ``dtype``)."""
        total = 0
        for part_shape, part_dtype in self.layout(shape, dtype):
            count = 1
            for size in part_shape:
                count *= size
            total += count * part_dtype.itemsize
        return total

    def bytes_per_element(self, dtype: torch.dtype) -> float:
        """Stored bytes per cached element, in the limit of long tensors."""
        if self.backend == "fp8":
            return 1.0
        packed = 4 / 10 if self.backend == "hqq" and self.nbits == 3 else self.nbits / 8
        return packed + 2 * dtype.itemsize / self.q_group_size


@dataclass
class QuantizedStates:
    """What a backend returns for one quantized tensor: its storages and the shape and
    dtype it dequantizes back to."""

    tensors: list[torch.Tensor]
    shape: tuple[int, ...]
    dtype: torch.dtype


def quantized(kvq: KvQuantization, shape: tuple[int, ...], dtype: torch.dtype) -> QuantizedStates:
    """Fresh (fake) storages of one quantized tensor."""
    parts = [torch.empty(s, dtype=d) for s, d in kvq.layout(tuple(shape), dtype)]
    return QuantizedStates(parts, tuple(shape), dtype)


def quantized_cache(config: Any, kvq: KvQuantization) -> Any:
    """A transformers ``Cache`` of quantized layers, one per decoder layer (the update
    logic transformers' own ``QuantizedLayer`` / ``Fp8QuantizedLayer``)."""
    from transformers import Cache
    from transformers.cache_utils import Fp8QuantizedLayer, QuantizedLayer

    class ModelledQuantizedLayer(QuantizedLayer):
        """transformers' residual-window layer with the backend's storage modelled."""

        def _quantize(self, tensor: torch.Tensor, axis: int) -> QuantizedStates:
            return quantized(kvq, tuple(tensor.shape), tensor.dtype)

        def _dequantize(self, states: QuantizedStates) -> torch.Tensor:
            return torch.empty(states.shape, dtype=states.dtype)

    text = config.get_text_config(decoder=True)
    layers = int(text.num_hidden_layers)
    if kvq.backend == "fp8":
        return Cache(layers=[Fp8QuantizedLayer() for _ in range(layers)])
    options = {
        "nbits": kvq.nbits,
        "q_group_size": kvq.q_group_size,
        "residual_length": kvq.residual_length,
    }
    return Cache(layers=[ModelledQuantizedLayer(**options) for _ in range(layers)])


def quantized_storages(layer: Any) -> list[torch.Tensor]:
    """The tensors holding a quantized layer's keys and values (quantized part only)."""
    found = []
    for states in (
        getattr(layer, "_quantized_keys", None),
        getattr(layer, "_quantized_values", None),
    ):
        if isinstance(states, QuantizedStates):
            found.extend(states.tensors)
        elif isinstance(states, tuple):  # fp8: (values, scale)
            found.extend(t for t in states if isinstance(t, torch.Tensor))
    return found
