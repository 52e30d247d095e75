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
        # as torchvision's references/segmentation: unlabelled pixels are 255, the aux
        # head's loss weighs 0.5
        loss = nn.functional.cross_entropy(output["out"], masks, ignore_index=255)
        if "aux" in output:
            aux = nn.functional.cross_entropy(output["aux"], masks, ignore_index=255)
            loss = loss + 0.5 * aux
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


def _torchvision_name(torchvision, name: str, known: list[str]) -> tuple[str, object]:
    """The builder for a name torchvision accepts: any case (``get_model`` lowers it) or a
    weights name (``ResNet50_Weights.IMAGENET1K_V2``); and the weights whose transforms
    give the default input size (the named ones, else the builder's ``DEFAULT``)."""
    models = torchvision.models
    if "_Weights" in name:
        try:
            weights = models.get_weight(name)
        except (ValueError, KeyError, AttributeError):
            raise UserError(f"unknown torchvision weights {name!r}") from None
        builder = next(m for m in known if models.get_model_weights(m) is type(weights))
        return builder, weights
    builder = name.lower()
    if builder not in known:
        return builder, None
    return builder, models.get_model_weights(builder).DEFAULT


def _weights_size(weights, fallback: int) -> int:
    """The crop (classification) or resize (segmentation) size of the weights' transforms."""
    keywords = getattr(getattr(weights, "transforms", None), "keywords", {})
    size = keywords.get("crop_size", keywords.get("resize_size", fallback))
    return size[0] if isinstance(size, (list, tuple)) else size


def build_torchvision(name: str, recipe: Recipe, device: str = "meta") -> BuiltModel:
    """A torchvision classification, segmentation, detection or video model, no weights."""
    torchvision = require_package("torchvision", "vision")
    classification = torchvision.models.list_models(module=torchvision.models)
    segmentation = torchvision.models.list_models(module=torchvision.models.segmentation)
    builder, weights = _torchvision_name(torchvision, name, classification + segmentation)
    if builder not in classification and builder not in segmentation:
        from vramplan.sources.detection import build_detection, detection_models

        detection = detection_models()  # with the ResNet-101 variants
        if builder in detection:
            return build_detection(builder, recipe, device)
        if builder in torchvision.models.list_models(module=torchvision.models.video):
            return _video(torchvision, builder, recipe, device)
        _refuse_other_tasks(torchvision, builder)
        raise _unknown("torchvision", name, classification + segmentation + detection)
    size = _weights_size(weights, 520 if builder in segmentation else 224)
    shape = _image_shape(recipe, size)
    kwargs = {"weights": None}
    if builder in segmentation:
        kwargs.update(weights_backbone=None)
        if not builder.startswith("lraspp"):  # LR-ASPP has no auxiliary head
            kwargs.update(aux_loss=True)
    if recipe.num_classes is not None:
        kwargs["num_classes"] = recipe.num_classes
    if builder.startswith("vit_") and shape[1] == shape[2]:  # ViT's positions fit one size
        kwargs["image_size"] = shape[1]
    with torch.device(device):
        model = torchvision.models.get_model(builder, **kwargs)
    if builder in segmentation:
        convs = [m for m in model.classifier.modules() if isinstance(m, nn.Conv2d)]
        built = _segmentation(builder, model, shape, convs[-1].out_channels)
    else:
        built = image_classifier(f"torchvision:{builder}", type(model).__name__, model, shape)
    if recipe.input_shape is None:
        built.notes.append(
            f"input {_shape_text(shape)}: the default size of torchvision's {weights} "
            "(--input-shape to change it)"
        )
    built.enable_checkpointing = checkpoint_repeated_blocks
    built.blocks = len(true_repeated_blocks(model))
    return built


# torchvision's model families vramplan does not train yet, and what each would need.
UNSUPPORTED_TASKS = {
    "optical_flow": "an optical-flow model: its step needs image pairs, flow targets and "
    "RAFT's sequence loss over the refinement iterations",
    "quantization": "a quantized model: torchvision's int8 models run fbgemm/qnnpack CPU "
    "kernels, not a CUDA training step",
}


def _refuse_other_tasks(torchvision, name: str) -> None:
    for family, what in UNSUPPORTED_TASKS.items():
        if name in torchvision.models.list_models(module=getattr(torchvision.models, family)):
            raise UserError(
                f"torchvision:{name} is {what}; vramplan does not build that step yet: write "
                "it as a step function and trace it with vramplan.estimate_step"
            )


def torchvision_tasks() -> dict[str, str]:
    """What vramplan trains for each torchvision model it accepts.

    >>> torchvision_tasks()["maskrcnn_resnet50_fpn"]
    'instance segmentation: train with targets (--boxes-per-image), infer'
    """
    import torchvision

    def names(module) -> list[str]:
        return torchvision.models.list_models(module=module)

    tasks = dict.fromkeys(names(torchvision.models), "classification: train, infer")
    segmentation = "semantic segmentation: train (cross-entropy, aux head), infer"
    tasks.update(dict.fromkeys(names(torchvision.models.segmentation), segmentation))
    video = "video classification: train, infer (--frames)"
    tasks.update(dict.fromkeys(names(torchvision.models.video), video))
    from vramplan.sources.detection import detection_models

    for name in detection_models():  # with the ResNet-101 variants
        kind = "detection"
        if name.startswith("maskrcnn"):
            kind = "instance segmentation"
        elif name.startswith("keypointrcnn"):
            kind = "keypoint detection"
        tasks[name] = f"{kind}: train with targets (--boxes-per-image), infer"
    return dict(sorted(tasks.items()))


# The clip side torchvision's video weights were trained at (KINETICS400_V1 transforms).
_CLIP_SIDES = {"r3d_18": 112, "mc3_18": 112, "r2plus1d_18": 112}
CLIP_FRAMES = 16


def _video(torchvision, name: str, recipe: Recipe, device: str) -> BuiltModel:
    """A torchvision video classifier on clips ``3 x T x H x W`` (``--frames`` sets T)."""
    shape = recipe.input_shape
    if shape is None:
        side = _CLIP_SIDES.get(name, 224)
        shape = (3, recipe.frames or CLIP_FRAMES, side, side)
    elif len(shape) != 4:
        raise UserError(f"video models take --input-shape CxTxHxW, got {shape}")
    elif recipe.frames is not None:
        shape = (shape[0], recipe.frames, *shape[2:])
    classes = {} if recipe.num_classes is None else {"num_classes": recipe.num_classes}
    with torch.device(device):
        model = torchvision.models.get_model(name, weights=None, **classes)
    fixed = _fixed_clip(model)
    if fixed is not None and tuple(shape[1:]) != fixed:
        raise UserError(
            f"torchvision:{name} takes clips of exactly {fixed[0]} frames of "
            f"{fixed[1]}x{fixed[2]} (its builder fixes the position layout to that size), "
            f"got {_shape_text(shape)}"
        )
    built = image_classifier(f"torchvision:{name}", type(model).__name__, model, shape)
    built.kind = "video"
    built.input_hint = "check --input-shape (CxTxHxW) / --frames"
    built.enable_checkpointing = checkpoint_repeated_blocks
    built.blocks = len(true_repeated_blocks(model))
    return built


def _fixed_clip(model: nn.Module) -> tuple[int, int, int] | None:
    """The one clip size ``(T, H, W)`` an MViT takes: its positional encoding is laid out
    for the patch grid of the size its builder gives (16x224x224), and forward reshapes
    the tokens to that grid; None for a model that takes any size."""
    position = getattr(model, "pos_encoding", None)
    if position is None:
        return None
    stride = model.conv_proj.stride
    grid = (position.temporal_size, *position.spatial_size)
    return tuple(side * step for side, step in zip(grid, stride, strict=True))


def _shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in shape)


def _timm_checkpointing(
    model: nn.Module, limit: int | None, every: int = 1, ops: bool = False
) -> int:
    """timm's own switch for all blocks; the chosen repeated blocks otherwise."""
    if limit is None and every == 1 and not ops and hasattr(model, "set_grad_checkpointing"):
        model.set_grad_checkpointing(True)
        return len(true_repeated_blocks(model))
    return checkpoint_repeated_blocks(model, limit, every, ops)


def build_timm(name: str, recipe: Recipe, device: str = "meta") -> BuiltModel:
    """A timm model, no weights (``pretrained=False``): any name ``timm.create_model``
    takes, a deprecated one (``xception`` is ``legacy_xception``) or one with a pretrained
    tag (``resnet50.a1_in1k``), whose pretrained config gives the default input size."""
    timm = require_package("timm", "timm")
    if not timm.is_model(name):
        raise _unknown("timm", name, timm.list_models())
    kwargs = {} if recipe.num_classes is None else {"num_classes": recipe.num_classes}
    try:
        with torch.device(device):
            model = timm.create_model(name, pretrained=False, **kwargs)
    except RuntimeError as exc:  # an unknown pretrained tag
        raise UserError(f"timm:{name}: {exc}") from None
    config = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", {})
    default = tuple(config.get("input_size", (3, 224, 224)))
    shape = recipe.input_shape or default
    if len(shape) != 3:
        raise UserError(f"image models take --input-shape CxHxW, got {shape}")
    resolved = ".".join(p for p in (config.get("architecture"), config.get("tag")) if p)
    built = image_classifier(f"timm:{name}", type(model).__name__, model, shape)
    if recipe.input_shape is None:
        built.notes.append(
            f"input {_shape_text(shape)}: the input size of timm's pretrained config "
            f"{resolved or name} (--input-shape to change it)"
        )
    if resolved and resolved.split(".")[0] != name.split(".")[0]:
        built.notes.append(f"timm:{name} is timm's deprecated name for {resolved}")
    built.enable_checkpointing = _timm_checkpointing
    built.blocks = len(true_repeated_blocks(model))
    return built
