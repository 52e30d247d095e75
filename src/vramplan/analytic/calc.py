"""``vramplan calc``: the classic memory arithmetic, exactly.

>>> est = calculate(20_000_000, 32, 1_000_000, Recipe(precision="fp32", optimizer="none"))
>>> est.peak.allocated_bytes
288000000
"""

from __future__ import annotations

import math

from vramplan.analytic.states import model_state_bytes
from vramplan.recipe import Recipe
from vramplan.result import Component, Estimate, ModelInfo, Peak, Phase, empty_components

METHODS = ("pytorch", "cs231n")


def activation_bytes(precision: str) -> int:
    """Bytes per activation value: 4 in fp32, 2 when activations are half precision."""
    return 4 if precision == "fp32" else 2


def cs231n_bytes(
    params: int, activations: int, input_values: int, batch: int, bytes_per_value: int = 4
) -> dict[str, int]:
    """The CS231n recipe: every activation twice (its gradient too) per sample, parameters
    three times (value, gradient, one optimizer cache), plus the input batch.

    >>> sum(cs231n_bytes(19_072_984, 532_752, 180 * 50 * 1, 128).values())
    779021856
    """
    return {
        Component.PARAMETERS: params * bytes_per_value,
        Component.GRADIENTS: params * bytes_per_value,
        Component.OPTIMIZER_STATE: params * bytes_per_value,
        Component.ACTIVATIONS: 2 * activations * batch * bytes_per_value,
        Component.INPUTS: input_values * batch * bytes_per_value,
    }


def calculate(
    params: int,
    batch: int,
    activations_per_sample: int,
    recipe: Recipe,
    method: str = "pytorch",
    input_shape: tuple[int, ...] | None = None,
) -> Estimate:
    """An Estimate from counts alone: model states by precision and optimizer, plus
    ``batch × activations × bytes`` (the CS231n recipe with ``method="cs231n"``)."""
    input_values = math.prod(input_shape) if input_shape else 0
    components = empty_components()
    if method == "cs231n":
        components.update(cs231n_bytes(params, activations_per_sample, input_values, batch))
    else:
        components.update(
            model_state_bytes(
                params, recipe.precision, recipe.optimizer, training=recipe.is_training
            )
        )
        per_value = activation_bytes(recipe.precision)
        components[Component.ACTIVATIONS] = batch * activations_per_sample * per_value
        components[Component.INPUTS] = batch * input_values * per_value
    total = sum(components.values())
    info = ModelInfo(
        name="calc",
        parameters=params,
        trainable_parameters=params,
        parameter_bytes=components[Component.PARAMETERS],
        kind="counts",
    )
    return Estimate(
        model=info,
        recipe=recipe,
        peak=Peak(allocated_bytes=total, phase=Phase.BACKWARD),
        components=components,
        method="calc",
        notes=(_explain(method),),
        details={
            "method": method,
            "activations_per_sample": activations_per_sample,
            "input_values_per_sample": input_values,
        },
    )


def _explain(method: str) -> str:
    if method == "cs231n":
        return (
            "CS231n recipe: activations x2 (their gradients) x batch, parameters x3, plus "
            "the input batch, 4 bytes each"
        )
    return (
        "model states by precision and optimizer (amp: fp32 masters, gradients and state) "
        "plus batch x activations x bytes; the runtime, the allocator and temporaries are "
        "not counted: trace a model with `vramplan estimate` for those"
    )
