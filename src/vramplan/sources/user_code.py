"""The user's own models: ``path/to/file.py:factory``, ``package.module:factory``, or an
``nn.Module`` passed in Python (copied structurally onto the meta device; its weights are
never touched)::

    built = build_from_factory("models/net.py:make_net", Recipe(input_shape=(3, 32, 32)))
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vramplan.errors import UserError, cuda_hint
from vramplan.limits import time_limit
from vramplan.recipe import Recipe
from vramplan.sources.base import Batch, BuiltModel, classification_loss
from vramplan.sources.blocks import checkpoint_repeated_blocks, true_repeated_blocks

DEFAULT_SEQ_LEN = 512


def load_factory(spec: str) -> Callable[[], Any]:
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise UserError(
            f"cannot read model {spec!r}: use path/to/file.py:factory or package.module:factory"
        )
    if target.endswith(".py"):
        path = Path(target).expanduser()
        if not path.is_file():
            raise UserError(f"model file not found: {path}")
        module_name = f"vramplan_user_{abs(hash(str(path.resolve())))}"
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.path.insert(0, str(path.parent.resolve()))
        try:
            with time_limit(f"importing {path}"):
                loader_spec.loader.exec_module(module)
        except UserError:
            raise
        except (Exception, SystemExit) as exc:
            raise UserError(f"importing {path} failed: {_reason(exc)}") from None
        finally:
            sys.path.pop(0)
    else:
        try:
            with time_limit(f"importing {target}"):
                module = importlib.import_module(target)
        except UserError:
            raise
        except (Exception, SystemExit) as exc:
            raise UserError(f"cannot import module {target!r}: {_reason(exc)}") from None
    factory = getattr(module, attr, None)
    if factory is None:
        raise UserError(f"{target} has no attribute {attr!r}")
    if not callable(factory):
        raise UserError(f"{target}:{attr} is not callable")
    return factory


def _reason(exc: BaseException) -> str:
    """One line for an exception from the user's code, with the GPU hint when it wanted one."""
    if isinstance(exc, SystemExit):
        return f"it called sys.exit({exc.code})"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}{cuda_hint(exc)}"


def _first_layer(model: nn.Module) -> nn.Module | None:
    for module in model.modules():
        if isinstance(
            module,
            (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, nn.Embedding, nn.LSTM, nn.GRU, nn.RNN),
        ):
            return module
    return None


def _default_shape(model: nn.Module, recipe: Recipe) -> tuple[int, ...]:
    """Guess one sample's shape from the first layer when the user gave none."""
    if recipe.input_shape:
        return recipe.input_shape
    first = _first_layer(model)
    seq = recipe.seq_len or DEFAULT_SEQ_LEN
    if isinstance(first, nn.Conv2d):
        return (first.in_channels, 224, 224)
    if isinstance(first, nn.Conv1d):
        return (first.in_channels, seq)
    if isinstance(first, nn.Conv3d):
        return (first.in_channels, 16, 112, 112)
    if isinstance(first, nn.Linear):
        return (first.in_features,)
    if isinstance(first, nn.Embedding):
        return (seq,)
    if isinstance(first, (nn.LSTM, nn.GRU, nn.RNN)):
        return (seq, first.input_size) if first.batch_first else (seq, first.input_size)
    raise UserError(
        "cannot guess this model's input: pass --input-shape (one sample, without the batch)"
    )


def generic_loss(output: Any) -> torch.Tensor:
    """Cross-entropy for ``(B, C)`` logits, else the mean of the first floating output."""
    tensor = output
    while not isinstance(tensor, torch.Tensor):
        if isinstance(tensor, dict):
            tensor = next(iter(tensor.values()))
        elif isinstance(tensor, (tuple, list)) and tensor:
            tensor = tensor[0]
        else:
            raise UserError("the model returned no tensor to take a loss of; use estimate_step()")
    if tensor.dim() == 2 and tensor.is_floating_point():
        labels = torch.randint(0, tensor.shape[1], (tensor.shape[0],), device=tensor.device)
        return classification_loss(tensor, labels)
    return tensor.float().mean()


def leading_dim(batch: Any) -> int:
    """The batch size: the first dimension of the batch's first tensor (1 when none)."""
    from torch.utils._pytree import tree_flatten

    for leaf in tree_flatten(batch)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return 1


def model_inputs(batch: Any) -> Any:
    """What ``forward`` gets from an example batch: a ``(inputs, targets)`` tuple or list
    feeds its first element (the loss gets the whole batch); anything else is the input.

    >>> model_inputs(("images", "labels"))
    'images'
    """
    if isinstance(batch, (tuple, list)) and batch:
        return batch[0]
    return batch


def call_with_inputs(module: nn.Module, inputs: Any) -> Any:
    """``module(inputs)``; a tuple of inputs is spread over ``forward``'s arguments and a
    dict passed as keyword arguments (``((ids, mask), labels)``, ``({"input_ids": ...},)``)."""
    if isinstance(inputs, tuple):
        return module(*inputs)
    if isinstance(inputs, dict):
        return module(**inputs)
    return module(inputs)


def module_source(
    model: nn.Module,
    recipe: Recipe,
    name: str,
    example_batch: Any = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    copy_to_meta: bool = True,
) -> BuiltModel:
    """Wrap an ``nn.Module`` (on any device, or meta) as a ``BuiltModel``; for tracing, a
    structural copy on the meta device, for a real run the module itself."""
    if not isinstance(model, nn.Module):
        raise UserError(f"{name} did not return an nn.Module (got {type(model).__name__})")
    from vramplan.sources.finetune import apply_finetune
    from vramplan.sources.hf import is_hf_model, wrap_hf_model

    if example_batch is None and loss_fn is None and is_hf_model(model):
        # a transformers model steps as the hf: source steps it: its own loss, batch, and
        # gradient checkpointing
        built = wrap_hf_model(meta_copy(model) if copy_to_meta else model, recipe, name)
        return apply_finetune(built, recipe, "meta" if copy_to_meta else "real")
    first = _first_layer(model)
    token_ids = isinstance(first, nn.Embedding)
    shape = None if example_batch is not None else _default_shape(model, recipe)
    batch_first = getattr(first, "batch_first", True)

    def make_batch(batch_size: int, dtype: torch.dtype) -> Batch:
        if example_batch is not None:
            from vramplan.trace.step import fake_copy

            return fake_copy(example_batch)
        if token_ids:
            return torch.randint(0, first.num_embeddings, (batch_size, *shape))
        if isinstance(first, (nn.LSTM, nn.GRU, nn.RNN)) and not batch_first:
            return torch.randn(shape[0], batch_size, *shape[1:], dtype=dtype)
        return torch.randn(batch_size, *shape, dtype=dtype)

    def run(module: nn.Module, batch: Batch, training: bool):
        output = call_with_inputs(module, model_inputs(batch))
        if not training:
            return output
        return loss_fn(output, batch) if loss_fn is not None else generic_loss(output)

    built = BuiltModel(
        name=name,
        architecture=type(model).__name__,
        kind="custom",
        model=meta_copy(model) if copy_to_meta else model,
        make_batch=make_batch,
        run=run,
        default_input_shape=shape or (),
        enable_checkpointing=checkpoint_repeated_blocks,
        blocks=len(true_repeated_blocks(model)),
        input_hint="check --input-shape / --seq-len"
        if example_batch is None
        else "check example_batch: forward gets its first element, loss_fn(output, batch) "
        "the whole batch",
        sequence=example_batch is None
        and not recipe.input_shape
        and isinstance(first, (nn.Embedding, nn.Conv1d, nn.LSTM, nn.GRU, nn.RNN)),
    )
    return apply_finetune(built, recipe, "meta" if copy_to_meta else "real")


def meta_copy(model: nn.Module) -> nn.Module:
    """A structural copy of ``model`` whose parameters and buffers live on the meta device.
    The original is left untouched, and no weight is copied."""
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = (
            nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
        )
    return copy.deepcopy(model, memo)


def build_from_factory(spec: str, recipe: Recipe, device: str = "meta") -> BuiltModel:
    """Import the user's factory and call it on the meta device (or ``device``)."""
    factory = load_factory(spec)
    try:
        with time_limit(f"factory {spec}"), torch.device(device):
            model = factory()
    except UserError:
        raise
    except SystemExit as exc:
        raise UserError(f"factory {spec} called sys.exit({exc.code})") from None
    except Exception as exc:
        raise UserError(f"factory {spec} raised {_reason(exc)}") from None
    return module_source(model, recipe, spec, copy_to_meta=device == "meta")
