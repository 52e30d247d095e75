"""Detection training traced with its targets and its data-dependent steps.

A small Mask R-CNN (torchvision's ``MaskRCNN`` around a two-convolution backbone) keeps
the test fast; its heads, samplers, NMS and losses are torchvision's own.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from vramplan.device.options import device_options
from vramplan.distributed.fsdp import Fsdp2
from vramplan.errors import UserError
from vramplan.measurement.run import measure_built
from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe
from vramplan.sources.data_dependent import CountMode, CountPolicy, Ledger, PolicySampler
from vramplan.sources.detection import build_detection, detection_source

torchvision = pytest.importorskip("torchvision")
from torchvision.models.detection import FasterRCNN, MaskRCNN  # noqa: E402
from torchvision.models.detection.anchor_utils import AnchorGenerator  # noqa: E402
from torchvision.ops import MultiScaleRoIAlign  # noqa: E402

SIZE = 96


def tiny_backbone() -> nn.Module:
    """Two strided convolutions, 32 output channels: the tiny detectors' feature map."""
    backbone = nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, 2, 1)
    )
    backbone.out_channels = 32
    return backbone


def tiny_detector_options() -> dict:
    """The tiny detectors' shared settings (fresh pooling modules each call)."""
    return {
        "num_classes": 5,
        "min_size": SIZE,
        "max_size": SIZE * 2,
        "rpn_anchor_generator": AnchorGenerator(((16, 32),), ((0.5, 1.0, 2.0),)),
        "box_roi_pool": MultiScaleRoIAlign(["0"], 7, 2),
        "rpn_pre_nms_top_n_train": 300,
        "rpn_post_nms_top_n_train": 200,
        "box_batch_size_per_image": 128,
        "representation_size": 64,
    }


def tiny_mask_rcnn(**options) -> nn.Module:
    mask_pool = MultiScaleRoIAlign(["0"], 14, 2)
    return MaskRCNN(tiny_backbone(), mask_roi_pool=mask_pool, **tiny_detector_options(), **options)


def _built(recipe: Recipe, device: str = "meta", image_sizes=None):
    with torch.device(device):
        model = tiny_mask_rcnn()
    return detection_source(model, "tiny-mask-rcnn", recipe, image_sizes)


RECIPE = Recipe(batch_size=2, input_shape=(3, SIZE, SIZE), optimizer="momentum", boxes_per_image=3)


def test_mask_rcnn_trains_with_targets_policies_order_and_sizes_pad_to_the_larger():
    sizes = [(3, SIZE, SIZE + 40), (3, SIZE // 2, SIZE // 2)]
    peaks, seen = {}, []
    for counts in ("max", "min"):
        recipe = RECIPE.with_changes(detection_counts=counts)
        built = _built(recipe, image_sizes=sizes)
        built.model.backbone.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape))
        estimate = estimate_built(built, recipe, target="cpu")
        peaks[counts] = estimate.peak.allocated_bytes
        assert any(f"policy {counts}" in note for note in estimate.notes)
    # max: 32 positives per image (128 x 0.25) run the mask head; min: the 3 ground-truth boxes
    assert peaks["max"] > peaks["min"]
    # the first image keeps its size (its short side is min_size), the second doubles to
    # 96x96; the batch takes the larger, its sides rounded up to a multiple of 32
    assert tuple(seen[0]) == (2, 3, SIZE, math.ceil((SIZE + 40) / 32) * 32)


def test_trace_matches_a_real_cpu_step_under_the_same_policy():
    """The real step runs the same policy (its samplers write the labels the counts stand
    for), so both take the same sizes; PyTorch's profiler gives the real peak."""
    recipe = RECIPE.with_changes(batch_size=1)
    traced = estimate_built(_built(recipe), recipe, target="cpu").peak.allocated_bytes
    real = measure_built(_built(recipe, "cpu"), recipe, "cpu", steps=2).allocated_bytes
    assert traced == pytest.approx(real, rel=0.03)


def test_the_max_policy_samples_as_many_as_torchvisions_sampler_on_a_busy_image():
    """A busy image has more positives than the cap and plenty of negatives: torchvision's
    own sampler then fills the whole batch (128 positives and 384 negatives in the box
    head); the max policy took every candidate positive and so sampled no negatives."""
    from torchvision.models.detection._utils import BalancedPositiveNegativeSampler

    real = BalancedPositiveNegativeSampler(512, 0.25)
    matched = torch.cat([torch.ones(600, dtype=torch.int64), torch.zeros(1400, dtype=torch.int64)])
    pos, neg = real([matched])
    ledger = Ledger()
    PolicySampler(real, CountPolicy("max", 3), ledger, "roi")([matched.clone()])
    assert ledger.sampled["roi"] == [(int(pos[0].sum()), int(neg[0].sum()))] == [(128, 384)]
    # and a Faster R-CNN's max step is then no smaller than its min step (it was: 128 of
    # the 512 regions per image went through the box head)
    peaks = {}
    for counts in ("max", "min"):
        recipe = RECIPE.with_changes(batch_size=1, detection_counts=counts)
        peaks[counts] = estimate_built(_faster(recipe), recipe).peak.allocated_bytes
    assert peaks["max"] >= peaks["min"]


def test_nms_and_nonzero_answer_with_the_policy_counts():
    with FakeTensorMode(), CountMode(Ledger()):
        boxes = torch.rand(50, 4)
        keep = torchvision.ops.nms(boxes, torch.rand(50), 0.5)
        found = torch.nonzero(torch.rand(7, 3) > 0.5)
        selected = torch.rand(10, 4)[torch.rand(10) > 0.5]
    assert tuple(keep.shape) == (50,)  # NMS keeps every box
    assert tuple(found.shape) == (21, 2)  # a mask is all true
    assert tuple(selected.shape) == (10, 4)


def test_a_torchvision_detection_model_builds_with_the_reference_backbone():
    built = build_detection("fasterrcnn_resnet50_fpn", RECIPE)
    frozen = [n for n, p in built.model.backbone.body.named_parameters() if not p.requires_grad]
    assert frozen and all(n.startswith(("conv1", "layer1")) for n in frozen)
    bn = type(built.model.backbone.body.bn1).__name__
    assert bn == "FrozenBatchNorm2d"


def _faster(recipe: Recipe, device: str = "meta"):
    with torch.device(device):
        model = FasterRCNN(tiny_backbone(), **tiny_detector_options())
    return detection_source(model, "tiny-faster-rcnn", recipe)


def test_masks_in_every_target_are_held_through_the_step_as_a_real_step_holds_them():
    """torchvision's reference scripts give every model a mask per box (their COCO loader
    converts each polygon); the masks ride in the batch and the transform resizes them."""
    plain = RECIPE.with_changes(batch_size=1, boxes_per_image=6)
    masked = plain.with_changes(targets_on_gpu="masks")
    without = estimate_built(_faster(plain), plain, target="cpu")
    traced = estimate_built(_faster(masked), masked, target="cpu")
    one_mask_set = math.ceil(6 * SIZE * SIZE / 512) * 512  # uint8, the allocator's rounding
    assert traced.components["inputs"] - without.components["inputs"] == one_mask_set
    assert any("--targets-on-gpu masks" in note for note in traced.notes)
    real = measure_built(_faster(masked, "cpu"), masked, "cpu", steps=2).allocated_bytes
    assert traced.peak.allocated_bytes == pytest.approx(real, rel=0.03)


def _faster_with_norms(recipe: Recipe, device: str = "meta"):
    """The tiny Faster R-CNN on a backbone normalised as ImageNet-initialised ones are."""
    from torchvision.ops import FrozenBatchNorm2d

    from vramplan.sources.detection import hold_norms_in_eval

    with torch.device(device):
        backbone = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1),
            FrozenBatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, 2, 1),
            FrozenBatchNorm2d(32),
        )
        backbone.out_channels = 32
        model = FasterRCNN(backbone, **tiny_detector_options())
    if recipe.backbone_norm == "eval":
        assert hold_norms_in_eval(model.backbone) == 2
    return detection_source(model, "tiny-faster-rcnn", recipe)


def test_norms_held_in_eval_keep_their_inputs_as_a_real_step_does():
    """mmdetection holds nn.BatchNorm2d in eval mode (norm_eval): batch_norm's backward
    reads its input, so autograd keeps it; FrozenBatchNorm2d's multiply-add keeps none."""
    frozen = RECIPE.with_changes(batch_size=1)
    held = frozen.with_changes(backbone_norm="eval")
    peaks = {
        recipe.backbone_norm: estimate_built(_faster_with_norms(recipe), recipe, target="cpu")
        for recipe in (frozen, held)
    }
    saved = {norm: e.components["activations"] for norm, e in peaks.items()}
    assert saved["eval"] > saved["frozen"]
    real = measure_built(_faster_with_norms(held, "cpu"), held, "cpu", steps=2).allocated_bytes
    assert peaks["eval"].peak.allocated_bytes == pytest.approx(real, rel=0.03)


def test_backbone_norm_eval_on_a_torchvision_detector():
    recipe = RECIPE.with_changes(backbone_norm="eval")
    built = build_detection("fasterrcnn_resnet50_fpn", recipe)
    body = built.model.backbone.body.train()
    norms = {n: m for n, m in body.named_modules() if isinstance(m, nn.BatchNorm2d)}
    assert len(norms) == 53 and not any(m.training for m in norms.values())
    # the norms train with their stage: conv1 and layer1 stay frozen (trainable layers 3)
    trains = {n: m.weight.requires_grad for n, m in norms.items()}
    assert {n for n, t in trains.items() if not t} == {
        n for n in norms if n.startswith(("bn1", "layer1"))
    }
    assert any("--backbone-norm eval" in note for note in built.notes)


def test_unknown_backbone_norm_is_a_user_error():
    from vramplan.errors import UserError

    with pytest.raises(UserError, match="backbone normalisation"):
        RECIPE.with_changes(backbone_norm="sync")


def _tiny_retinanet(recipe: Recipe, device: str = "meta"):
    from torchvision.models.detection import RetinaNet

    from vramplan.sources.focal_loss import use_fused_focal_loss

    with torch.device(device):
        anchors = AnchorGenerator(((16, 32),), ((0.5, 1.0, 2.0),))
        model = RetinaNet(
            tiny_backbone(), 5, min_size=SIZE, max_size=SIZE * 2, anchor_generator=anchors
        )
    if recipe.focal_loss == "fused":
        assert use_fused_focal_loss(model)
    return detection_source(model, "tiny-retinanet", recipe)


def test_a_fused_focal_loss_keeps_less_than_torchvision_s_as_a_real_step_shows():
    """mmcv's kernel keeps the logits and labels; torchvision's op-by-op loss keeps a
    one-hot target and its intermediates, each the size of the logits."""
    ops = RECIPE
    fused = ops.with_changes(focal_loss="fused")
    traced = {
        r.focal_loss: estimate_built(_tiny_retinanet(r), r, target="cpu").peak.allocated_bytes
        for r in (ops, fused)
    }
    logits = 2 * 3 * (SIZE // 4) ** 2 * 5 * 4  # images x anchors x classes, fp32
    assert traced["ops"] - traced["fused"] >= 2 * logits
    for recipe in (ops, fused):
        real = measure_built(_tiny_retinanet(recipe, "cpu"), recipe, "cpu", steps=2)
        assert traced[recipe.focal_loss] == pytest.approx(real.allocated_bytes, rel=0.03)


def test_fused_focal_loss_on_a_model_without_one_is_a_user_error():
    from vramplan.errors import UserError

    with pytest.raises(UserError, match="no focal loss"):
        build_detection("fasterrcnn_resnet50_fpn", RECIPE.with_changes(focal_loss="fused"))


def test_fsdp_in_bf16_names_the_cast_of_the_targets():
    """FSDP2's MixedPrecisionPolicy casts the targets' boxes to bf16 with the images, and
    torchvision's RoI heads refuse them (a real step fails alike); the error said to check
    --input-shape and --boxes-per-image."""
    recipe = RECIPE.with_changes(batch_size=1, precision="amp-bf16")
    device = device_options(gpu="h100", data_parallel=2)
    with pytest.raises(UserError, match="casts every floating-point input to bfloat16"):
        estimate_built(_built(recipe), recipe, "cuda", device, engine=Fsdp2(2))


@pytest.mark.parametrize("build", [_built, _tiny_retinanet], ids=["mask-rcnn", "retinanet"])
def test_images_without_objects_train_as_a_real_cpu_step_does(build):
    """COCO's background images: empty targets (boxes 0x4, masks 0xHxW). torchvision
    matches every anchor and proposal to the background, so no policy has a positive; the
    meta kernel of the masks' resize (an empty batch) no longer stops the trace."""
    peaks = {}
    for counts in ("max", "min"):
        recipe = RECIPE.with_changes(batch_size=1, boxes_per_image=0, detection_counts=counts)
        estimate = estimate_built(build(recipe), recipe, target="cpu")
        peaks[counts] = estimate.peak.allocated_bytes
        assert any(f"images without objects (policy {counts}" in n for n in estimate.notes)
    assert peaks["max"] == peaks["min"]
    recipe = RECIPE.with_changes(batch_size=1, boxes_per_image=0)
    real = measure_built(build(recipe, "cpu"), recipe, "cpu", steps=2).allocated_bytes
    assert peaks["max"] == pytest.approx(real, rel=0.03)
    with pytest.raises(UserError, match="boxes per image must be a whole number"):
        RECIPE.with_changes(boxes_per_image=-1)


def test_the_samplers_take_negatives_only_without_a_ground_truth_box():
    from torchvision.models.detection._utils import BalancedPositiveNegativeSampler

    ledger = Ledger()
    sampler = PolicySampler(
        BalancedPositiveNegativeSampler(512, 0.25), CountPolicy("max", 0), ledger, "roi"
    )
    sampler([torch.zeros(2000, dtype=torch.int64)])
    assert ledger.sampled["roi"] == [(0, 512)]


def test_the_busiest_image_holds_its_boxes_and_traces_as_a_real_cpu_step_does():
    """``--busiest-image-boxes``: the last image's targets hold N boxes (masks too), the
    other's ``--boxes-per-image``; the inputs grow by exactly the extra boxes'
    targets (exact arithmetic: the CPU allocator does not round), and the step's peak is a
    real CPU step's."""
    uniform = RECIPE.with_changes(boxes_per_image=3, targets_on_gpu="masks")
    busiest = uniform.with_changes(busiest_image_boxes=12)
    images, targets = _faster(busiest).make_batch(2, torch.float32)
    assert [t["boxes"].shape[0] for t in targets] == [3, 12]
    assert [t["masks"].shape[0] for t in targets] == [3, 12]
    plain = estimate_built(_faster(uniform), uniform, target="cpu")
    busy = estimate_built(_faster(busiest), busiest, target="cpu")
    # nine more boxes: a uint8 mask, four float32 coordinates and an int64 label each
    assert busy.components["inputs"] - plain.components["inputs"] == 9 * (SIZE * SIZE + 16 + 8)
    assert any("the last image holds 12 ground-truth boxes, the others 3" in n for n in busy.notes)
    real = measure_built(_faster(busiest, "cpu"), busiest, "cpu", steps=2).allocated_bytes
    assert busy.peak.allocated_bytes == pytest.approx(real, rel=0.03)


def test_the_min_policy_matches_the_busiest_image_s_own_boxes():
    policy = CountPolicy("min", 3, busiest_image_boxes=12)
    assert [policy.positives(2000, image, 2) for image in (0, 1)] == [3, 12]


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"busiest_image_boxes": 0}, "must be a positive integer"),
        ({"busiest_image_boxes": 5, "boxes_per_image": 0}, "needs --boxes-per-image of 1"),
    ],
)
def test_bad_busiest_image_boxes_are_user_errors(changes, message):
    with pytest.raises(UserError, match=message):
        RECIPE.with_changes(**changes)
