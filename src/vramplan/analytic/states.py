"""Bytes per parameter of weights, gradients and optimizer state, by precision and optimizer.

These are the figures the tracer produces for the same recipe (PyTorch's optimizers keep
state in the parameter's dtype; amp keeps fp32 master weights, fp32 gradients and fp32
state, the 16 bytes per parameter of mixed-precision Adam in the ZeRO paper)::

    >>> model_state_bytes(7_000_000_000, "fp32", "adam")["optimizer_state"]
    56000000000
    >>> sum(model_state_bytes(1, "amp-bf16", "adamw").values())
    16
"""

from __future__ import annotations

from vramplan.errors import UserError
from vramplan.result import Component

# State tensors per parameter, each in the parameter's dtype.
STATE_COPIES = {
    "sgd": 0,
    "none": 0,
    "momentum": 1,
    "adam": 2,
    "adamw": 2,
    "adagrad": 1,
    "rmsprop": 1,
    "lion": 1,
    "adafactor": 0,
}
# bitsandbytes 8-bit Adam: two uint8 states and an fp32 absmax per 256-element block each.
ADAM8BIT_BYTES = 2 + 2 * 4 / 256
# ... and its two 256-entry fp32 quantization maps (qmap1, qmap2), shared by every parameter.
ADAM8BIT_QMAPS = 2 * 256 * 4


def weight_bytes(precision: str) -> int:
    """Bytes of one stored parameter: 2 for pure fp16/bf16, else 4 (fp32 or amp masters)."""
    return 2 if precision in ("fp16", "bf16") else 4


def model_state_bytes(
    params: int, precision: str, optimizer: str, trainable: int | None = None, training: bool = True
) -> dict[str, int]:
    """Parameters, gradients and optimizer state in bytes for ``params`` parameters
    (``trainable`` of them trained; all by default)."""
    if params < 0 or (trainable is not None and trainable < 0):
        raise UserError("parameter counts must not be negative")
    trained = params if trainable is None else trainable
    per = weight_bytes(precision)
    if not training:
        return {
            Component.PARAMETERS: params * per,
            Component.GRADIENTS: 0,
            Component.OPTIMIZER_STATE: 0,
        }
    if optimizer == "adam8bit":
        state = round(trained * ADAM8BIT_BYTES) + (ADAM8BIT_QMAPS if trained else 0)
    elif optimizer in STATE_COPIES:
        state = trained * per * STATE_COPIES[optimizer]
    else:
        raise UserError(f"unknown optimizer {optimizer!r}")
    return {
        Component.PARAMETERS: params * per,
        Component.GRADIENTS: trained * per,
        Component.OPTIMIZER_STATE: state,
    }
