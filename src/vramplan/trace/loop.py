"""The training (or inference) loop that both the tracer and real measurements run.

One definition of "a step" keeps the trace and the measurement comparable::

    run_steps(built, model, batch, optimizer, recipe, autocast=nullcontext,
              mark_phase=lambda phase, iteration: None)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from vramplan.recipe import Recipe
from vramplan.result import Phase
from vramplan.sources.base import Batch, BuiltModel

ITERATIONS = 2
# Micro-steps run per iteration under gradient accumulation: from the second one on,
# memory repeats (the gradients already exist), so running more changes nothing.
MAX_MICRO_STEPS = 2

PhaseMarker = Callable[[Phase, int], None]


def micro_steps(recipe: Recipe) -> int:
    """How many forward/backward passes one iteration runs."""
    return min(recipe.grad_accum, MAX_MICRO_STEPS)


def frees_gradients(recipe: Recipe, default: bool) -> bool:
    """Whether ``zero_grad`` sets gradients to None: ``recipe.zero_grad`` (``none`` or
    ``zeros``), or under ``auto`` the emulated PyTorch's ``default``.

    >>> frees_gradients(Recipe(zero_grad="zeros"), True), frees_gradients(Recipe(), False)
    (False, False)
    """
    return default if recipe.zero_grad == "auto" else recipe.zero_grad == "none"


def run_steps(
    built: BuiltModel,
    model: torch.nn.Module,
    batch: Batch,
    optimizer: torch.optim.Optimizer | None,
    recipe: Recipe,
    *,
    autocast: Callable[[], contextlib.AbstractContextManager],
    mark_phase: PhaseMarker,
    iterations: int = ITERATIONS,
    after_optimizer: Callable[[], None] = lambda: None,
    set_to_none: bool = True,
    skips_passes: Callable[[int], bool] = lambda iteration: False,
    copies_micro_step: Callable[[int, int], bool] = lambda iteration, micro_step: False,
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
) -> None:
    """Run ``iterations`` steps: forward+loss, backward (per micro-step), optimizer step,
    ``zero_grad(set_to_none=...)`` (``False``: gradients zeroed in place and kept, as
    PyTorch before 2.0 did by default; after the first forward pass of the next step where
    ``built.zero_grad_after_forward``, as Keras does); inference runs forward under
    ``no_grad`` only. An iteration whose ``skips_passes(iteration)`` is true runs no
    forward or backward pass (the tracer writes them from the first iteration's:
    ``trace/copied_iteration.py``), only its optimizer step. A micro-step for which
    ``copies_micro_step(iteration, micro_step)`` is true is not run either (the tracer
    writes it from the first: ``trace/copied_micro_step.py``). The whole loop runs under
    ``built.step_context()``."""
    with built.step_context():
        for iteration in range(1, iterations + 1):
            copied = skips_passes(iteration)
            if not recipe.is_training:
                if not copied:
                    mark_phase(Phase.FORWARD, iteration)
                    with torch.no_grad(), autocast():
                        output = built.run(model, batch, False)
                    del output
                continue
            for micro_step in range(0 if copied else micro_steps(recipe)):
                if copies_micro_step(iteration, micro_step):
                    continue
                mark_phase(Phase.FORWARD, iteration)
                with autocast():
                    loss = built.run(model, batch, True)
                if built.zero_grad_after_forward and micro_step == 0:
                    model.zero_grad(set_to_none=True)
                if recipe.grad_accum > 1:
                    loss = loss / recipe.grad_accum
                mark_phase(Phase.BACKWARD, iteration)
                backward(loss)
                del loss
            mark_phase(Phase.OPTIMIZER, iteration)
            if optimizer is not None:
                optimizer.step()
                after_optimizer()
            if built.zero_grad_after_forward:
                continue
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=set_to_none)
            else:
                model.zero_grad(set_to_none=set_to_none)
