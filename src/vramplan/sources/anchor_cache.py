"""The anchors an old torchvision ``AnchorGenerator`` kept from step to step (``anchor_cache``).

Until pytorch/vision PR #1657 (December 2019, so torchvision 0.5 with PyTorch 1.4),
``AnchorGenerator.cached_grid_anchors`` stored the anchors of every feature-map geometry it
met in ``self._cache`` (keyed by the grid sizes and strides) and never cleared it: issue
#1689 reported the leak, #1657 added ``self._cache.clear()`` at the end of ``forward``, and
issue #3667 (2021) describes both. A training run on torchvision 0.3 or 0.4 therefore holds
on the GPU the anchors of every padded batch shape its images produced, and
``max_memory_allocated`` over the run counts them all.

Which padded shapes a run meets depends on the images; under the count policy ``max`` it
is every shape the model's transform can produce: an image is resized so that its short
side is a ``min_size`` unless its long side would pass ``max_size`` (then the long side is
``max_size``), and a batch is padded to the largest height and width of its images,
rounded up to ``size_divisible``. The aspect-ratio grouping of the reference scripts never
batches portrait with landscape images, so a batch's shape is the pairwise maximum of two
shapes of one orientation.

>>> shapes = padded_batch_shapes((800,), 1333, 32, batch_size=2)
>>> (800, 1344) in shapes, (1344, 800) in shapes, (800, 800) in shapes, len(shapes)
(True, True, True, 83)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn


def _up(size: int, divisible: int) -> int:
    return int(math.ceil(size / divisible) * divisible)


def _landscape_singles(min_sizes: Sequence[int], max_size: int, divisible: int) -> set:
    """Padded (height, width) of one landscape image (width >= height) of any aspect ratio."""
    shapes = set()
    for short in min_sizes:
        long_cap = max(max_size, short)
        # the short side reaches min_size: the long side runs from short to max_size
        for width in range(_up(short, divisible), _up(long_cap, divisible) + 1, divisible):
            shapes.add((_up(short, divisible), width))
        # the long side reaches max_size: the short side is anything below min_size
        for height in range(divisible, _up(short, divisible) + 1, divisible):
            shapes.add((height, _up(long_cap, divisible)))
    return shapes


def padded_batch_shapes(
    min_sizes: Sequence[int], max_size: int, divisible: int, batch_size: int
) -> set[tuple[int, int]]:
    """Every padded (height, width) a batch of ``batch_size`` images can take through a
    ``GeneralizedRCNNTransform`` (both orientations; a batch holds one orientation)."""
    singles = _landscape_singles(min_sizes, max_size, divisible)
    batches = set(singles)
    if batch_size > 1:
        batches |= {(max(a[0], b[0]), max(a[1], b[1])) for a in singles for b in singles}
    return batches | {(w, h) for h, w in batches}


def level_size(size: int, stride: int) -> int:
    """A feature map's side at ``stride`` for an input side ``size``: each stride-2 step of
    these backbones (3x3 padding 1, 1x1 padding 0, max-pool 3x3 padding 1 or 1x1) rounds up.

    >>> level_size(800, 64), level_size(1344, 64)
    (13, 21)
    """
    for _ in range(int(round(math.log2(stride)))):
        size = (size + 1) // 2
    return size


def cached_anchor_count(
    shapes: set[tuple[int, int]], strides: Sequence[int], anchors_per_location: Sequence[int]
) -> int:
    """Anchors (rows of 4 coordinates) the cache holds for ``shapes``: each feature level
    contributes its locations times its anchors per location."""
    return sum(
        per_location * level_size(height, stride) * level_size(width, stride)
        for height, width in shapes
        for stride, per_location in zip(strides, anchors_per_location, strict=True)
    )


def padded_shape(
    image_sizes: Sequence[tuple[int, int]], min_size: int, max_size: int, divisible: int
) -> tuple[int, int]:
    """The padded (height, width) of one batch of images of these (height, width) sizes.

    >>> padded_shape([(480, 640), (427, 640)], 800, 1333, 32)
    (800, 1216)
    """
    heights, widths = [], []
    for height, width in image_sizes:
        scale = min(min_size / min(height, width), max_size / max(height, width))
        heights.append(int(math.floor(height * scale)))
        widths.append(int(math.floor(width * scale)))
    return _up(max(heights), divisible), _up(max(widths), divisible)


def _level_strides(model: nn.Module, side: int = 256) -> list[int]:
    """The backbone's feature strides, from the feature maps of one ``side`` x ``side`` input."""
    device = next(model.parameters()).device
    with torch.no_grad():
        features = model.backbone(torch.zeros(1, 3, side, side, device=device))
    maps = features.values() if isinstance(features, dict) else [features]
    return [2 ** int(round(math.log2(side / fmap.shape[-2]))) for fmap in maps]


def hold_cached_anchors(
    model: nn.Module, traced: Sequence[tuple[int, int]], batch_size: int
) -> str | None:
    """Register, as a buffer of ``model``, the anchors an old ``AnchorGenerator`` cache holds
    for every padded batch shape but the traced batch's (whose anchors the trace makes);
    ``traced`` is the (height, width) of each image of the traced batch. The note, or None
    for a model without a torchvision ``AnchorGenerator``."""
    generator = getattr(getattr(model, "rpn", model), "anchor_generator", None)
    if generator is None or not hasattr(generator, "cell_anchors"):
        return None
    transform = model.transform
    divisible = transform.size_divisible
    shapes = padded_batch_shapes(transform.min_size, transform.max_size, divisible, batch_size)
    shapes.discard(padded_shape(traced, max(transform.min_size), transform.max_size, divisible))
    count = cached_anchor_count(shapes, _level_strides(model), generator.num_anchors_per_location())
    device = next(model.parameters()).device
    model.register_buffer(
        "vramplan_anchor_cache", torch.empty(count, 4, device=device), persistent=False
    )
    return (
        f"anchor_cache: the anchors of {len(shapes)} other padded batch shapes "
        f"({count * 16 / 2**20:.0f} MiB) held as torchvision < 0.5's AnchorGenerator "
        "cache keeps them (every shape the transform can produce: policy max)"
    )
