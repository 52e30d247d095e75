"""``torchvision:NAME`` and ``timm:NAME``: image models built on the meta device.

>>> built = build_torchvision("resnet50", Recipe(batch_size=8))
>>> built.default_input_shape
(3, 224, 224)
"""

from __future__ import annotations

import difflib

import torch
from torch import nn

from vramplan.errors import UserError
from vramplan.recipe import Recipe
from vramplan.sources.base import Batch, BuiltModel, image_classifier
from vramplan.sources.blocks import (
    checkpoint_repeated_blocks,
    true_repeated_blocks,
)

_DEFAULT_SIZES = {"inception_v3": 299}


def require_package(module: str, extra: str):
    try:
        return __import__(module)
    except ImportError:
        raise UserError(f"{module} is not installed: pip install 'vramplan[{extra}]'") from None


def _unknown(kind: str, name: str, known: list[str]) -> UserError:
    close = difflib.get_close_matches(name, known, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return UserError(f"unknown {kind} model {name!r}{hint}")


def _image_shape(recipe: Recipe, size: int, channels: int = 3) -> tuple[int, ...]:
    if recipe.input_shape is None:
        return (channels, size, size)
    if len(recipe.input_shape) != 3:
        raise UserError(f"image models take --input-shape CxHxW, got {recipe.input_shape}")
    return recipe.input_shape


def _segmentation(name: str, model: nn.Module, shape: tuple[int, ...], classes: int) -> BuiltModel:
    def make_batch(batch_size: int, dtype: torch.dtype) -> Batch:
        images = torch.randn(batch_size, *shape, dtype=dtype)
        masks = torch.randint(0, classes, (batch_size, shape[1], shape[2]))
        return images, masks

    def run(module: nn.Module, batch: Batch, training: bool):
        images, masks = batch
        output = module(images)
        if not training:
            return output
        loss = nn.functional.cross_entropy(output["out"], masks)
        if "aux" in output:
            loss = loss + 0.5 * nn.functional.cross_entropy(output["aux"], masks)
        return loss

    return BuiltModel(
        name=f"torchvision:{name}",
        architecture=type(model).__name__,
        kind="segmentation",
        model=model,
        make_batch=make_batch,
        run=run,
        default_input_shape=shape,
    )


def build_torchvision(name: str, recipe: Recipe, device: str = "meta") -> BuiltModel:
    """A torchvision classification or segmentation model, no weights."""
    torchvision = require_package("torchvision", "vision")
    classification = torchvision.models.list_models(module=torchvision.models)
    segmentation = torchvision.models.list_models(module=torchvision.models.segmentation)
    if name not in classification and name not in segmentation:
        detection = torchvision.models.list_models(module=torchvision.models.detection)
        if name in detection:
            raise UserError(
                f"torchvision:{name} is a detection model: its loss needs data-dependent box "
                "matching that fake tensors cannot run; estimate its backbone instead"
            )
        raise _unknown("torchvision", name, classification + segmentation)
    size = _DEFAULT_SIZES.get(name, 520 if name in segmentation else 224)
    shape = _image_shape(recipe, size)
    kwargs = {"weights": None}
    if name in segmentation:
        kwargs.update(weights_backbone=None, aux_loss=True)
    with torch.device(device):
        model = torchvision.models.get_model(name, **kwargs)
    if name in segmentation:
        built = _segmentation(name, model, shape, model.classifier[-1].out_channels)
    else:
        built = image_classifier(f"torchvision:{name}", type(model).__name__, model, shape)
    built.enable_checkpointing = checkpoint_repeated_blocks
    built.blocks = len(true_repeated_blocks(model))
    return built


def _timm_checkpointing(
    model: nn.Module, limit: int | None, every: int = 1, ops: bool = False
) -> int:
    """timm's own switch for all blocks; the chosen repeated blocks otherwise."""
    if limit is None and every == 1 and not ops and hasattr(model, "set_grad_checkpointing"):
        model.set_grad_checkpointing(True)
        return len(true_repeated_blocks(model))
    return checkpoint_repeated_blocks(model, limit, every, ops)


def build_timm(name: str, recipe: Recipe, device: str = "meta") -> BuiltModel:
    """A timm model, no weights (``pretrained=False``)."""
    timm = require_package("timm", "timm")
    known = timm.list_models()
    if name not in known:
        raise _unknown("timm", name, known)
    with torch.device(device):
        model = timm.create_model(name, pretrained=False)
    default = tuple(getattr(model, "default_cfg", {}).get("input_size", (3, 224, 224)))
    shape = recipe.input_shape or default
    if len(shape) != 3:
        raise UserError(f"image models take --input-shape CxHxW, got {shape}")
    built = image_classifier(f"timm:{name}", type(model).__name__, model, shape)
    built.enable_checkpointing = _timm_checkpointing
    built.blocks = len(true_repeated_blocks(model))
    return built
