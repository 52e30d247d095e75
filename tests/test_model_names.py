"""Every name the vision libraries accept, with the model's own default input size."""

from __future__ import annotations

import pytest
import torch

from vramplan.errors import UserError
from vramplan.recipe import Recipe
from vramplan.sources import resolve


def _fits(built) -> tuple[int, ...]:
    """The default input shape, checked by a forward pass on the meta device."""
    images = torch.empty(1, *built.default_input_shape, device="meta")
    built.model.eval()(images)
    return built.default_input_shape


def test_timm_deprecated_name_resolves_as_timm_does():
    import timm

    built = resolve("timm:xception", Recipe())
    expected = timm.models.get_pretrained_cfg("legacy_xception").input_size
    assert _fits(built) == tuple(expected) == (3, 299, 299)
    assert type(built.model).__name__ == "Xception"
    assert any("deprecated name for legacy_xception" in n for n in built.notes)


def test_timm_pretrained_tag_gives_its_input_size():
    import timm

    built = resolve("timm:resnet50.a1_in1k", Recipe())
    assert _fits(built) == tuple(timm.models.get_pretrained_cfg("resnet50.a1_in1k").input_size)
    assert any("resnet50.a1_in1k" in n for n in built.notes)
    with pytest.raises(UserError, match="Invalid pretrained tag"):
        resolve("timm:resnet50.no_such_tag", Recipe())


def test_torchvision_default_size_from_its_weights():
    from torchvision.models import Inception_V3_Weights

    built = resolve("torchvision:inception_v3", Recipe())
    crop = Inception_V3_Weights.DEFAULT.transforms.keywords["crop_size"]
    assert _fits(built) == (3, crop, crop) == (3, 299, 299)
    assert any("299" in n for n in built.notes)
    # a shape the user gives wins, and no note claims a default
    given = resolve("torchvision:inception_v3", Recipe(input_shape=(3, 320, 320)))
    assert given.default_input_shape == (3, 320, 320) and not given.notes


@pytest.mark.parametrize(
    "spec", ["torchvision:ResNet18", "torchvision:ResNet18_Weights.IMAGENET1K_V1"]
)
def test_torchvision_names_as_users_copy_them(spec):
    assert type(resolve(spec, Recipe()).model).__name__ == "ResNet"


@pytest.mark.parametrize("spec", ["timm:resnet18", "torchvision:resnet18"])
def test_num_classes_sets_the_head(spec):
    built = resolve(spec, Recipe(num_classes=7))
    last = [m for m in built.model.modules() if isinstance(m, torch.nn.Linear)][-1]
    assert last.out_features == 7
