"""Video clips, the per-model task list and the refusal of tasks vramplan does not train."""

from __future__ import annotations

import pytest

from vramplan.errors import UserError
from vramplan.measurement.run import measure_built
from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe
from vramplan.sources import model_tasks, resolve

torchvision = pytest.importorskip("torchvision")


def test_a_video_clip_step_matches_a_real_cpu_step():
    recipe = Recipe(batch_size=1, input_shape=(3, 4, 32, 32), frames=2, optimizer="sgd")
    built = resolve("torchvision:r3d_18", recipe)
    assert built.default_input_shape == (3, 2, 32, 32)  # --frames replaces T
    traced = estimate_built(built, recipe, target="cpu").peak.allocated_bytes
    real = measure_built(resolve("torchvision:r3d_18", recipe, "cpu"), recipe, "cpu", steps=2)
    # the CPU's slow_conv3d keeps im2col columns of its own (3.5 MB of 271 MB here)
    assert traced == pytest.approx(real.allocated_bytes, rel=0.02)


def test_video_models_want_a_clip_shape():
    with pytest.raises(UserError, match="CxTxHxW"):
        resolve("torchvision:r3d_18", Recipe(input_shape=(3, 112, 112)))


def test_every_torchvision_model_has_its_task_and_other_families_are_explained():
    tasks = model_tasks("torchvision")
    assert "targets" in tasks["keypointrcnn_resnet50_fpn"]
    assert tasks["swin3d_t"].startswith("video")
    assert tasks["lraspp_mobilenet_v3_large"].startswith("semantic segmentation")
    with pytest.raises(UserError, match="optical-flow model: its step needs image pairs"):
        resolve("torchvision:raft_small", Recipe())
    with pytest.raises(UserError, match="quantized model"):
        resolve("torchvision:quantized_resnet18", Recipe())


@pytest.mark.parametrize(
    ("spec", "option", "message"),
    [
        ("torchvision:resnet18", {"frames": 4}, "--frames applies to video models"),
        ("torchvision:resnet18", {"boxes_per_image": 3}, "--boxes-per-image applies to detection"),
        ("torchvision:resnet18", {"busiest_image_boxes": 93}, "--busiest-image-boxes applies"),
        ("torchvision:r3d_18", {"detection_counts": "min"}, "--detection-counts applies to"),
        ("torchvision:lraspp_mobilenet_v3_large", {"targets_on_gpu": "masks"}, "--targets-on"),
        ("torchvision:r3d_18", {"resolution": 256}, "--resolution applies to diffusers models"),
        ("torchvision:resnet18", {"diffusion_encoders": "frozen"}, "--diffusion-encoders"),
    ],
)
def test_a_task_option_on_a_model_of_another_kind_is_refused(spec, option, message):
    # each was read by nothing: the estimate went on without it and did not say so
    with pytest.raises(UserError, match=message):
        resolve(spec, Recipe(**option))


def test_num_classes_sizes_the_heads_of_video_and_detection_models():
    video = resolve("torchvision:r3d_18", Recipe(num_classes=10)).model
    assert video.fc.out_features == 10
    mask_rcnn = resolve("torchvision:maskrcnn_resnet50_fpn", Recipe(num_classes=5)).model
    assert mask_rcnn.roi_heads.box_predictor.cls_score.out_features == 5
    assert mask_rcnn.roi_heads.mask_predictor.mask_fcn_logits.out_channels == 5
    retina = resolve("torchvision:retinanet_resnet101_fpn", Recipe(num_classes=3)).model
    assert retina.head.classification_head.num_classes == 3
    with pytest.raises(UserError, match="at least 2"):
        resolve("torchvision:fasterrcnn_resnet50_fpn", Recipe(num_classes=1))


def test_mvit_takes_only_the_clip_size_its_builder_lays_out():
    # torchvision's mvit_v2_s fixes temporal_size=16, spatial_size=(224, 224): 4 frames
    # failed inside the trace ("shape '[1, 96, 8, 56, 56]' is invalid for input of size ...")
    with pytest.raises(UserError, match="exactly 16 frames of 224x224"):
        resolve("torchvision:mvit_v2_s", Recipe(frames=4))
    assert resolve("torchvision:mvit_v2_s", Recipe()).default_input_shape == (3, 16, 224, 224)
    assert resolve("torchvision:swin3d_t", Recipe(frames=4)).default_input_shape[1] == 4


def test_a_batch_norm_over_one_value_says_to_raise_the_batch():
    # DeepLabV3's ASPP pools each image to 1x1 before a BatchNorm: batch 1 fails in a real
    # step too; the error said to check --input-shape / --seq-len
    recipe = Recipe(batch_size=1, input_shape=(3, 64, 64), optimizer="sgd")
    with pytest.raises(UserError, match="raise --batch-size"):
        estimate_built(resolve("torchvision:deeplabv3_mobilenet_v3_large", recipe), recipe)
