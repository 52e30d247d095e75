"""The ResNet-101 FPN variants of torchvision's R-50 detection builders (the model zoos
publish both): only the trunk differs, laid out as the reference scripts train it."""

from __future__ import annotations

import pytest
import torch

from vramplan.recipe import Recipe
from vramplan.sources import resolve

torchvision = pytest.importorskip("torchvision")
from torchvision.models import resnet50, resnet101  # noqa: E402
from torchvision.ops import FrozenBatchNorm2d  # noqa: E402


def count(module, trainable: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable)


@pytest.mark.parametrize("head", ["fasterrcnn", "maskrcnn", "retinanet"])
def test_a_resnet101_variant_differs_from_the_r50_model_by_the_trunk_alone(head):
    recipe = Recipe(batch_size=2)
    r50 = resolve(f"torchvision:{head}_resnet50_fpn", recipe).model
    r101 = resolve(f"torchvision:{head}_resnet101_fpn", recipe).model
    with torch.device("meta"):  # the trunks' difference (their fc heads cancel)
        extra = count(resnet101(norm_layer=FrozenBatchNorm2d)) - count(
            resnet50(norm_layer=FrozenBatchNorm2d)
        )
    assert type(r101) is type(r50)
    assert count(r101) - count(r50) == extra
    # the same frozen stem and layer1 (trainable_backbone_layers=3): the extra blocks train
    assert count(r101, trainable=True) - count(r50, trainable=True) == extra
    assert sum(isinstance(m, FrozenBatchNorm2d) for m in r101.modules()) > sum(
        isinstance(m, FrozenBatchNorm2d) for m in r50.modules()
    )
