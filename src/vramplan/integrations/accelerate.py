"""accelerate: a drop-in for ``accelerate.utils.find_executable_batch_size`` that starts
from the batch vramplan predicts fits the card, instead of halving down from a guess::

    from vramplan.integrations.accelerate import find_executable_batch_size

    @find_executable_batch_size(model=model, gpu="a10g", seq_len=1024, precision="amp-bf16")
    def train(batch_size, model, optimizer):
        ...

    train(model, optimizer)   # first try: the largest batch that fits the A10G

The prediction is made on the first call (a trace per candidate batch on the CPU, the
model's weights untouched); an out-of-memory error at run time still lowers the batch the
way accelerate does (``reduce_batch_size_fn``, by default 10% each time).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from vramplan.errors import UserError
from vramplan.recipe import Recipe
from vramplan.session import Session

DEVICE_OPTIONS = ("gpu", "gpu_memory", "headroom", "alloc_conf", "profile", "stack", "timeout")


def predicted_batch_size(model: nn.Module | str, **options: Any) -> int:
    """The largest batch of ``model`` that fits the card (``gpu=`` or ``gpu_memory=``) with
    the headroom kept free; the other options are the Recipe's knobs (``seq_len``,
    ``precision``, ``optimizer``, ``checkpointing``, ``lora_rank``...)."""
    device = {k: v for k, v in options.items() if k in DEVICE_OPTIONS}
    knobs = {k: v for k, v in options.items() if k not in DEVICE_OPTIONS}
    if device.get("gpu") is None and device.get("gpu_memory") is None:
        raise UserError("give the card: gpu='a10g' (or gpu_memory='24GiB')")
    recipe = Recipe(**{**knobs, "batch_size": 1})
    return Session(model, **device).max_batch(recipe).value


def _accelerate_finder():
    try:
        from accelerate.utils import find_executable_batch_size as finder
    except ImportError:
        raise UserError("accelerate is not installed: pip install accelerate") from None
    return finder


def find_executable_batch_size(
    function: Callable | None = None,
    starting_batch_size: int | None = None,
    reduce_batch_size_fn: Callable[[], int] | None = None,
    *,
    model: nn.Module | str | None = None,
    **options: Any,
):
    """accelerate's decorator, started from ``predicted_batch_size(model, **options)``
    (capped at ``starting_batch_size`` when given). ``function(batch_size, ...)`` gets the
    batch as its first argument, exactly as under accelerate; ``wrapper.predicted`` holds
    the prediction once made."""
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
            model=model,
            **options,
        )
    if model is None:
        raise UserError("find_executable_batch_size needs model= (an nn.Module or a name)")
    finder = _accelerate_finder()
    state: dict[str, Callable] = {}

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "run" not in state:
            predicted = predicted_batch_size(model, **options)
            wrapper.predicted = predicted
            start = min(predicted, starting_batch_size) if starting_batch_size else predicted
            state["run"] = finder(
                function, starting_batch_size=start, reduce_batch_size_fn=reduce_batch_size_fn
            )
        return state["run"](*args, **kwargs)

    wrapper.predicted = None
    return wrapper
