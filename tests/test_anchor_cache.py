"""torchvision < 0.5's anchor cache (``anchor_cache``): the padded batch shapes a run can
meet and the anchors kept for each.

Ground truth: torchvision's own ``GeneralizedRCNNTransform`` and ``AnchorGenerator`` on real
CPU runs (the shapes they produce, the anchors they return).
"""

from __future__ import annotations

import random

import pytest
import torch

from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe
from vramplan.result import Component
from vramplan.sources.anchor_cache import (
    _level_strides,
    cached_anchor_count,
    padded_batch_shapes,
    padded_shape,
)
from vramplan.sources.detection import detection_source

torchvision = pytest.importorskip("torchvision")
from torchvision.models.detection import FasterRCNN  # noqa: E402
from torchvision.models.detection.image_list import ImageList  # noqa: E402
from torchvision.models.detection.transform import GeneralizedRCNNTransform  # noqa: E402

MIN_SIZES, MAX_SIZE, DIVISIBLE = (40, 48), 80, 8


def _transform() -> GeneralizedRCNNTransform:
    transform = GeneralizedRCNNTransform(MIN_SIZES, MAX_SIZE, [0.0] * 3, [1.0] * 3, DIVISIBLE)
    return transform.train()


def _padded(transform, sizes, min_size) -> tuple[int, int]:
    transform.torch_choice = lambda choices: min_size
    images, _ = transform([torch.zeros(3, h, w) for h, w in sizes])
    return tuple(images.tensors.shape[-2:])


def test_one_image_takes_exactly_the_shapes_the_real_transform_makes():
    transform = _transform()
    seen = set()
    for min_size in MIN_SIZES:
        for height in range(2, 161, 3):
            for width in range(2, 161, 3):
                seen.add(_padded(transform, [(height, width)], min_size))
    assert seen == padded_batch_shapes(MIN_SIZES, MAX_SIZE, DIVISIBLE, batch_size=1)


def test_a_batch_of_one_orientation_takes_a_shape_in_the_set():
    transform = _transform()
    predicted = padded_batch_shapes(MIN_SIZES, MAX_SIZE, DIVISIBLE, batch_size=2)
    largest = max(MIN_SIZES)
    rng = random.Random(0)
    for _ in range(300):
        sizes = [sorted((rng.randint(2, 200), rng.randint(2, 200))) for _ in range(2)]
        assert _padded(transform, sizes, rng.choice(MIN_SIZES)) in predicted
        expected = padded_shape(sizes, largest, MAX_SIZE, DIVISIBLE)
        assert _padded(transform, sizes, largest) == expected


def test_the_anchor_count_is_what_the_real_generator_returns():
    torch.manual_seed(0)
    model = torchvision.models.detection.fasterrcnn_resnet50_fpn(
        weights=None, weights_backbone=None
    ).eval()
    generator = model.rpn.anchor_generator
    strides = _level_strides(model)
    assert strides == [4, 8, 16, 32, 64]
    for shape in ((64, 96), (96, 160), (160, 96)):
        images = torch.zeros(1, 3, *shape)
        with torch.no_grad():
            features = list(model.backbone(images).values())
        anchors = generator(ImageList(images, [shape]), features)[0]
        counted = cached_anchor_count({shape}, strides, generator.num_anchors_per_location())
        assert counted == anchors.shape[0]


def test_the_cache_is_a_buffer_of_the_anchors_of_every_other_shape():
    """A tiny Faster R-CNN: the step with the cache holds, beyond the step without it, the
    anchors the real generator makes for every padded shape but the traced one."""
    from tests.test_detection import SIZE, tiny_backbone, tiny_detector_options

    recipe = Recipe(batch_size=2, input_shape=(3, SIZE, SIZE), optimizer="sgd", boxes_per_image=3)
    buffers = {}
    for cache in (False, True):
        with torch.device("meta"):
            model = FasterRCNN(tiny_backbone(), **tiny_detector_options())
        built = detection_source(model, "tiny", recipe.with_changes(anchor_cache=cache))
        estimate = estimate_built(built, recipe, target="cpu")
        buffers[cache] = estimate.components[Component.BUFFERS]
    real = FasterRCNN(tiny_backbone(), **tiny_detector_options()).eval()
    transform = real.transform
    shapes = padded_batch_shapes(transform.min_size, transform.max_size, 32, batch_size=2)
    shapes.discard((SIZE, SIZE))  # the traced batch's
    anchors = 0
    for shape in shapes:
        images = torch.zeros(1, 3, *shape)
        with torch.no_grad():
            features = [real.backbone(images)]
        anchors += real.rpn.anchor_generator(ImageList(images, [shape]), features)[0].shape[0]
    assert buffers[True] - buffers[False] == anchors * 4 * 4
