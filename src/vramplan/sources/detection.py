"""``torchvision:`` detection and instance-segmentation models trained with their targets.

The batch is what torchvision's reference scripts (``references/detection/train.py``)
hand the model: a list of images and a list of targets (``boxes``, ``labels``, ``masks``
at image size for Mask R-CNN, or for every model with ``--targets-on-gpu masks`` as the
reference scripts' COCO loader makes them, ``keypoints`` for Keypoint R-CNN); the model's own
``GeneralizedRCNNTransform`` (or SSD's) resizes them to ``min_size``/``max_size`` and pads
the batch to the largest image, rounded up to a multiple of 32. The loss is the sum of
the model's loss dict. The data-dependent steps run under a ``CountPolicy``
(``data_dependent.py``). The backbone is laid out as the reference scripts train it: an
ImageNet-initialised backbone (``--weights-backbone``: FrozenBatchNorm2d, the first layers
frozen by ``trainable_backbone_layers``), except SSDlite, which they train from scratch;
no weights are loaded.

>>> built = build_detection("fasterrcnn_resnet50_fpn", Recipe(batch_size=2))
>>> built.kind, built.default_input_shape
('detection', (3, 800, 1333))
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from vramplan.errors import UserError
from vramplan.recipe import Recipe
from vramplan.sources.anchor_cache import hold_cached_anchors
from vramplan.sources.base import Batch, BuiltModel
from vramplan.sources.data_dependent import CountPolicy, Ledger, PolicySampler, counted
from vramplan.sources.focal_loss import use_fused_focal_loss

# The reference scripts train these from scratch (no --weights-backbone).
FROM_SCRATCH = ("ssdlite320_mobilenet_v3_large",)
_SKIPPED = object()


def detection_models() -> list[str]:
    """torchvision's detection model names, and the ResNet-101 variants of its R-50 ones."""
    import torchvision

    return torchvision.models.list_models(module=torchvision.models.detection) + list(
        RESNET101_VARIANTS
    )


# torchvision builds these heads on a ResNet-50 FPN only; the model zoos (mmdetection,
# detectron2) publish them on ResNet-101 too. Built as the R-50 builders build theirs with
# ImageNet backbone weights: FrozenBatchNorm2d, 3 trainable layers, 91 COCO classes.
RESNET101_VARIANTS = {
    "fasterrcnn_resnet101_fpn": "FasterRCNN",
    "maskrcnn_resnet101_fpn": "MaskRCNN",
    "keypointrcnn_resnet101_fpn": "KeypointRCNN",
    "retinanet_resnet101_fpn": "RetinaNet",
}


def _resnet101_variant(name: str, options: dict) -> nn.Module:
    from torchvision.models import detection, resnet101
    from torchvision.models.detection.backbone_utils import _resnet_fpn_extractor
    from torchvision.ops import FrozenBatchNorm2d
    from torchvision.ops.feature_pyramid_network import LastLevelP6P7

    trunk = resnet101(weights=None, norm_layer=FrozenBatchNorm2d)
    kind = RESNET101_VARIANTS[name]
    options = dict(options)
    classes = options.pop("num_classes", 2 if kind == "KeypointRCNN" else 91)
    if kind == "RetinaNet":  # as retinanet_resnet50_fpn: P3-P5, P6/P7 from P5
        backbone = _resnet_fpn_extractor(
            trunk, 3, returned_layers=[2, 3, 4], extra_blocks=LastLevelP6P7(256, 256)
        )
    else:
        backbone = _resnet_fpn_extractor(trunk, 3)
    return getattr(detection, kind)(backbone, num_classes=classes, **options)


@contextlib.contextmanager
def _backbone_layout_without_weights() -> Iterator[None]:
    """Let a builder take its ``weights_backbone`` branch (FrozenBatchNorm2d, frozen
    layers) without downloading or loading anything."""
    from torchvision.models._api import WeightsEnum

    get_state_dict = WeightsEnum.get_state_dict
    load_state_dict = nn.Module.load_state_dict

    def skip_loading(module, state_dict, *args, **kwargs):
        if state_dict is _SKIPPED:
            return None
        return load_state_dict(module, state_dict, *args, **kwargs)

    WeightsEnum.get_state_dict = lambda *args, **kwargs: _SKIPPED
    nn.Module.load_state_dict = skip_loading
    try:
        yield
    finally:
        WeightsEnum.get_state_dict = get_state_dict
        nn.Module.load_state_dict = load_state_dict


def _build(name: str, device: str, options: dict) -> nn.Module:
    import torchvision

    if name in RESNET101_VARIANTS:
        with torch.device(device):
            return _resnet101_variant(name, options)
    kwargs = {"weights": None, **options}
    if name in FROM_SCRATCH:
        kwargs["weights_backbone"] = None
    with _backbone_layout_without_weights(), torch.device(device):
        return torchvision.models.get_model(name, **kwargs)


def _image_shapes(recipe: Recipe, default: tuple[int, int, int], sizes) -> list[tuple]:
    if sizes:
        return [tuple(s) for s in sizes]
    shape = recipe.input_shape or default
    if len(shape) != 3:
        raise UserError(f"detection models take --input-shape CxHxW, got {shape}")
    return [shape]


def _policy_hooks(model: nn.Module, policy: CountPolicy, ledger: Ledger) -> None:
    """Samplers with the policy's counts; the multi-scale size choice at its largest."""
    for head, owner in (("rpn", "rpn"), ("roi", "roi_heads")):
        module = getattr(model, owner, None)
        if module is not None and hasattr(module, "fg_bg_sampler"):
            module.fg_bg_sampler = PolicySampler(module.fg_bg_sampler, policy, ledger, head)
    model.transform.torch_choice = max  # the largest of the multi-scale min sizes


def build_detection(
    name: str,
    recipe: Recipe,
    device: str = "meta",
    image_sizes: Sequence[tuple[int, int, int]] | None = None,
    model_options: dict | None = None,
) -> BuiltModel:
    """A torchvision detection model with a synthetic batch of images and targets;
    ``image_sizes`` (one CxHxW per image, cycled over the batch) overrides
    ``--input-shape`` to mix sizes in one batch; ``model_options`` go to the builder
    (``min_size``, ``rpn_post_nms_top_n_train``, ``box_batch_size_per_image``, ...)."""
    if name not in detection_models():
        raise UserError(f"torchvision:{name} is not a detection model")
    options = dict(model_options or {})
    if recipe.num_classes is not None:
        if recipe.num_classes < 2:  # labels are 1..N-1; 0 is the background
            raise UserError(
                f"--num-classes {recipe.num_classes}: a detection model's classes count the "
                "background (class 0), so at least 2"
            )
        options.setdefault("num_classes", recipe.num_classes)
    model = _build(name, device, options)
    backbone = _lay_out_backbone(name, model, recipe)
    if recipe.focal_loss == "fused" and not use_fused_focal_loss(model):
        raise UserError(f"--focal-loss fused: torchvision:{name} has no focal loss (RetinaNet has)")
    built = detection_source(model, f"torchvision:{name}", recipe, image_sizes)
    built.notes.append(backbone)
    if recipe.focal_loss == "fused":
        built.notes.append(
            "classification loss as one fused kernel (--focal-loss fused, mmcv's "
            "SigmoidFocalLossFunction as mmdetection's RetinaNet calls it): the logits and "
            "labels kept, a per-element loss weighted by the anchors' label weights"
        )
    return built


def _lay_out_backbone(name: str, model: nn.Module, recipe: Recipe) -> str:
    """Hold the backbone's norms as ``recipe.backbone_norm`` asks; the note saying how the
    backbone is laid out."""
    if name in FROM_SCRATCH:
        return "backbone trained from scratch, as torchvision's reference script does"
    if recipe.backbone_norm == "eval":
        swapped = hold_norms_in_eval(model.backbone)
        return (
            f"backbone from ImageNet weights with its {swapped} norms as nn.BatchNorm2d held in "
            "eval mode (--backbone-norm eval, mmdetection's norm_eval=True): each keeps its "
            "input for backward, which FrozenBatchNorm2d does not; their affine parameters "
            "train where their stage trains (trainable_backbone_layers default); no weights "
            "loaded"
        )
    return (
        "backbone laid out as the reference scripts train it from ImageNet weights "
        "(FrozenBatchNorm2d, trainable_backbone_layers default); no weights loaded"
    )


class EvalBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` that stays in eval mode when its model trains, as mmdetection's
    ResNet holds its norms under ``norm_eval=True``: running statistics, no update, and
    (unlike ``FrozenBatchNorm2d``'s multiply-add) a ``batch_norm`` whose backward reads
    its input, so autograd keeps that input.

    >>> norm = EvalBatchNorm2d(4).train()
    >>> norm.training
    False
    """

    def train(self, mode: bool = True) -> EvalBatchNorm2d:
        return super().train(False)


def hold_norms_in_eval(backbone: nn.Module) -> int:
    """Replace every ``FrozenBatchNorm2d`` of ``backbone`` with an ``EvalBatchNorm2d`` whose
    affine parameters train when the convolution before it does; the count replaced.

    >>> from torchvision.models.detection.backbone_utils import resnet_fpn_backbone
    >>> from torchvision.ops import FrozenBatchNorm2d
    >>> with torch.device("meta"):
    ...     backbone = resnet_fpn_backbone(backbone_name="resnet18", weights=None,
    ...                                    norm_layer=FrozenBatchNorm2d, trainable_layers=3)
    >>> hold_norms_in_eval(backbone)
    20
    """
    from torchvision.ops import FrozenBatchNorm2d

    count = 0
    for parent in list(backbone.modules()):
        previous = None
        for child_name, child in list(parent.named_children()):
            if isinstance(child, FrozenBatchNorm2d):
                trains = previous is not None and previous.weight.requires_grad
                with torch.device(child.weight.device):
                    norm = EvalBatchNorm2d(child.weight.shape[0], eps=child.eps)
                norm.requires_grad_(trains)
                setattr(parent, child_name, norm.train(False))
                count += 1
            elif isinstance(getattr(child, "weight", None), nn.Parameter):
                previous = child
    return count


def _boxes_note(recipe: Recipe) -> str:
    """The note on the batch's ground-truth boxes.

    >>> _boxes_note(Recipe(batch_size=2, busiest_image_boxes=93)).split(" (")[0]
    'the last image holds 93 ground-truth boxes, the others 20'
    >>> _boxes_note(Recipe(batch_size=1, busiest_image_boxes=93)).split(" (")[0]
    'the image holds 93 ground-truth boxes'
    """
    boxes = f"{recipe.boxes_per_image} ground-truth boxes per image"
    if recipe.busiest_image_boxes is not None and recipe.batch_size == 1:
        boxes = f"the image holds {recipe.busiest_image_boxes} ground-truth boxes"
    elif recipe.busiest_image_boxes is not None:
        boxes = (
            f"the last image holds {recipe.busiest_image_boxes} ground-truth boxes, the "
            f"others {recipe.boxes_per_image}"
        )
    return (
        f"{boxes} (--boxes-per-image, --busiest-image-boxes; the anchor matching's IoU "
        "matrices grow with them, so a run peaks on its busiest image: 93 boxes in COCO "
        "train2017)"
    )


def detection_source(
    model: nn.Module,
    name: str,
    recipe: Recipe,
    image_sizes: Sequence[tuple[int, int, int]] | None = None,
) -> BuiltModel:
    """A ``BuiltModel`` for any torchvision-style detection model (a ``GeneralizedRCNN``,
    ``RetinaNet``, ``FCOS`` or ``SSD`` built by the caller, on the meta device for tracing)."""
    policy = CountPolicy(
        recipe.detection_counts, recipe.boxes_per_image, recipe.busiest_image_boxes
    )
    ledger = Ledger(boxes=recipe.boxes_per_image)
    _policy_hooks(model, policy, ledger)
    transform = model.transform
    default = (3, max(transform.min_size), transform.max_size)
    shapes = _image_shapes(recipe, default, image_sizes)
    classes = _classes(model)
    keypoints = getattr(getattr(model, "roi_heads", None), "keypoint_predictor", None)
    mask_head = getattr(getattr(model, "roi_heads", None), "mask_predictor", None) is not None
    with_masks = mask_head or recipe.targets_on_gpu == "masks"

    def make_batch(batch_size: int, dtype: torch.dtype) -> Batch:
        images, targets = [], []
        for index in range(batch_size):
            channels, height, width = shapes[index % len(shapes)]
            boxes = policy.boxes(index, batch_size)
            images.append(torch.rand(channels, height, width, dtype=dtype))
            corner = torch.rand(boxes, 2) * torch.tensor([width / 2, height / 2])
            target = {
                "boxes": torch.cat([corner, corner + torch.tensor([width / 2, height / 2])], 1),
                "labels": torch.randint(1, classes, (boxes,)),
            }
            if with_masks:
                target["masks"] = torch.zeros(boxes, height, width, dtype=torch.uint8)
            if keypoints is not None:
                target["keypoints"] = torch.ones(boxes, _keypoint_count(model), 3)
            targets.append(target)
        return images, targets

    def run(module: nn.Module, batch: Batch, training: bool):
        images, targets = batch
        ledger.sampled.clear()
        _anchor_templates(module)
        with counted(ledger):
            if not training:
                return module(images)
            try:
                losses = module(images, targets)
            except TypeError as exc:
                raise _explained(exc, name) from None
        return sum(losses.values())

    notes = [policy.note(), _boxes_note(recipe)]
    if recipe.anchor_cache:
        traced = [shapes[index % len(shapes)][1:] for index in range(recipe.batch_size)]
        note = hold_cached_anchors(model, traced, recipe.batch_size)
        notes += [note] if note else []
    if with_masks and not mask_head:
        notes.append(
            "a uint8 mask per box in every target (--targets-on-gpu masks), resized with its "
            "image by the model's transform and held through the step"
        )
    return BuiltModel(
        name=name,
        architecture=type(model).__name__,
        kind="detection",
        model=model,
        make_batch=make_batch,
        run=run,
        default_input_shape=default,
        notes=notes,
        input_hint="check --input-shape (CxHxW) and --boxes-per-image",
    )


def _explained(exc: TypeError, name: str) -> Exception:
    """Say why a target reached torchvision's heads in bfloat16: FSDP2's mixed precision
    (``MixedPrecisionPolicy.cast_forward_inputs``) casts every floating-point input to
    ``param_dtype``, the targets' boxes too, and ``RoIHeads.check_targets`` takes float32,
    float64 and float16 boxes only."""
    if "must of float type, instead got torch.bfloat16" not in str(exc):
        return exc
    return UserError(
        f"{name} under FSDP2 in bf16: fully_shard's MixedPrecisionPolicy casts every "
        "floating-point input to bfloat16, the targets' boxes too (cast_forward_inputs), and "
        "torchvision's heads refuse bfloat16 boxes, so a real step fails the same way "
        f"({exc})"
    )


def _anchor_templates(model: nn.Module) -> None:
    """Rebuild the anchor templates the generators hold in plain lists (not buffers, so
    built on the meta device) as tensors of the running mode."""
    for module in model.modules():
        if hasattr(module, "cell_anchors"):  # AnchorGenerator
            module.cell_anchors = [
                module.generate_anchors(size, ratios)
                for size, ratios in zip(module.sizes, module.aspect_ratios, strict=True)
            ]
        if hasattr(module, "_wh_pairs"):  # SSD's DefaultBoxGenerator
            module._wh_pairs = module._generate_wh_pairs(len(module.aspect_ratios))


def _classes(model: nn.Module) -> int:
    heads = getattr(model, "roi_heads", None)
    if heads is not None:
        return heads.box_predictor.cls_score.out_features
    head = model.head.classification_head
    return getattr(head, "num_classes", None) or head.num_columns  # SSD names it num_columns


def _keypoint_count(model: nn.Module) -> int:
    return model.roi_heads.keypoint_predictor.kps_score_lowres.out_channels
