"""What every model source returns: a model on the meta device and how to feed it.

>>> from vramplan.recipe import Recipe
>>> from vramplan.sources import resolve
>>> built = resolve("torchvision:resnet18", Recipe(batch_size=2))
>>> built.kind, built.default_input_shape, next(built.model.parameters()).device.type
('image', (3, 224, 224), 'meta')
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vramplan.recipe import Recipe

Batch = Any


@dataclass
class BuiltModel:
    """A model built without memory, plus the functions that make and consume a batch.

    ``make_batch(batch_size, float_dtype)`` runs under fake tensors; ``run(model, batch, training)``
    returns the loss when training and the model output otherwise.
    """

    name: str
    architecture: str
    kind: str
    model: nn.Module
    make_batch: Callable[[int, torch.dtype], Batch]
    run: Callable[[nn.Module, Batch, bool], Any]
    default_input_shape: tuple[int, ...] = ()
    enable_checkpointing: Callable[..., int] | None = None
    """``(model, limit, every=1, ops=False)``: recompute the first ``limit`` blocks (all
    when None), every ``every``-th of them, with ``ops`` under torchtitan's op-level
    policy, in backward; returns the number of checkpointable blocks."""
    notes: list[str] = field(default_factory=list)
    repeat_blocks: bool = True
    """Trace a run of identical blocks once and repeat it (``trace/repeat.py``) where that
    is exact; False traces every block (``--full-trace``)."""
    copy_iteration: bool = True
    """Write the second training iteration's passes from the first's where that is exact
    (``trace/copied_iteration.py``); False traces both (``--full-trace``)."""
    blocks: int = 0
    """Repeated blocks ``enable_checkpointing`` can recompute (0: none)."""
    sequence: bool = False
    """Whether the input has a token/sequence length that ``--seq-len`` sets."""
    input_hint: str = "check --input-shape / --seq-len"
    """What to check when the model fails on the example batch."""
    short_traces: dict | None = None
    """Where block repetition keeps its short traces for reuse by later estimates of the
    same model on the same card (a planner's ``Workbench`` passes one; None: not kept)."""
    generator: Any = None
    """How ``generate`` calls the model (``sources/generation.py`` ``Generator``): set for
    transformers causal language models, None for models that do not generate."""
    make_optimizer: Callable[[list[nn.Parameter], Recipe], Any] | None = None
    """The framework's own optimizer over the trainable parameters, as a
    ``torch.optim.Optimizer`` (Keras's update on its torch backend); None, or None
    returned: vramplan's ``build_optimizer`` for ``--optimizer``."""
    forward_context: Callable[[], AbstractContextManager] = nullcontext
    """What every call of the model runs under (a transformers model: its value checks off
    where fake tensors cannot answer them, one sequence per row for its causal mask), so
    that a loss that replaces ``run``'s (``sources/loss.py``) calls the model as ``run``
    does."""
    step_context: Callable[[], AbstractContextManager] = nullcontext
    """What the whole step runs under, backward's recomputation of checkpointed blocks
    included (``--repeat-kv``: transformers' SDPA repeating K and V); every loop that runs
    the model enters it (``trace/loop.run_steps``, the traced ``generate``)."""
    zero_grad_after_forward: bool = False
    """Whether the framework's step clears the gradients after the forward pass rather than
    after the optimizer step (Keras's ``train_step`` on the torch backend): the previous
    step's gradients then stay alive through the next forward pass."""


def classification_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a classifier's logits (or the first tensor of its output)."""
    logits = output
    if isinstance(output, (tuple, list)):
        logits = output[0]
    elif isinstance(output, dict):
        logits = next(iter(output.values()))
    return nn.functional.cross_entropy(logits, labels)


def infer_classes(model: nn.Module) -> int:
    """Number of outputs of the model's last linear layer (its classes)."""
    last = None
    for module in model.modules():
        if isinstance(module, nn.Linear):
            last = module
    return last.out_features if last is not None else 1000


def image_classifier(
    name: str, architecture: str, model: nn.Module, input_shape: tuple[int, ...]
) -> BuiltModel:
    """A ``BuiltModel`` for a model that maps ``(B, C, H, W)`` images to class logits."""
    classes = infer_classes(model)

    def make_batch(batch_size: int, dtype: torch.dtype) -> Batch:
        images = torch.randn(batch_size, *input_shape, dtype=dtype)
        labels = torch.randint(0, classes, (batch_size,))
        return images, labels

    def run(module: nn.Module, batch: Batch, training: bool) -> Any:
        images, labels = batch
        output = module(images)
        return classification_loss(output, labels) if training else output

    return BuiltModel(
        name=name,
        architecture=architecture,
        kind="image",
        model=model,
        make_batch=make_batch,
        run=run,
        default_input_shape=input_shape,
    )
