"""The traced peak matches a real CPU run of the same step within 1%.

The real run (``vramplan.measure``) takes its peak from PyTorch's profiler (allocation
events of the CPU allocator); the trace runs the same two steps under fake tensors with
the CPU policy.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vramplan.measurement.run import measure_built
from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe
from vramplan.sources import resolve
from vramplan.sources.user_code import module_source


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.features(x))


def tiny_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(128, 512),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    )


def tiny_vit() -> nn.Module:
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer(
        image_size=32,
        patch_size=8,
        num_layers=2,
        num_heads=2,
        hidden_dim=64,
        mlp_dim=128,
        num_classes=10,
    )


def _compare(make_built, recipe: Recipe) -> tuple[int, int]:
    traced = estimate_built(make_built(recipe), recipe, target="cpu").peak.allocated_bytes
    real = measure_built(make_built(recipe), recipe, "cpu", steps=2).allocated_bytes
    return traced, real


def _module_built(factory, shape):
    def make(recipe: Recipe):
        with torch.device("meta"):
            model = factory()
        return module_source(model, recipe.with_changes(input_shape=shape), factory.__name__)

    return make


@pytest.fixture
def gpt2_two_layers(gpt2_config):
    path = gpt2_config(
        vocab_size=1000, n_positions=128, n_embd=64, n_head=4, tie_word_embeddings=True
    )
    return lambda recipe: resolve(f"hf:{path}", recipe)


CASES = [
    ("mlp-sgd", tiny_mlp, (128,), dict(batch_size=32, optimizer="sgd")),
    ("mlp-adamw", tiny_mlp, (128,), dict(batch_size=32, optimizer="adamw")),
    ("mlp-infer", tiny_mlp, (128,), dict(batch_size=32, mode="infer")),
    ("cnn-momentum", TinyCNN, (3, 32, 32), dict(batch_size=8, optimizer="momentum")),
    ("cnn-adam-accum", TinyCNN, (3, 32, 32), dict(batch_size=8, optimizer="adam", grad_accum=2)),
    ("vit-adamw", tiny_vit, (3, 32, 32), dict(batch_size=4, optimizer="adamw")),
    (
        "vit-checkpointed",
        tiny_vit,
        (3, 32, 32),
        dict(batch_size=4, optimizer="adamw", checkpointing="full"),
    ),
]


@pytest.mark.parametrize("label,factory,shape,knobs", CASES, ids=[c[0] for c in CASES])
def test_traced_peak_matches_real_cpu_run(label, factory, shape, knobs):
    traced, real = _compare(_module_built(factory, shape), Recipe(**knobs))
    assert real > 0
    assert abs(traced - real) <= 0.01 * real, (label, traced, real)


@pytest.mark.parametrize(
    "knobs",
    [
        dict(batch_size=2, seq_len=32, optimizer="adamw"),
        dict(batch_size=2, seq_len=32, optimizer="sgd", checkpointing="full"),
    ],
)
def test_gpt2_two_layers_matches_real_cpu_run(gpt2_two_layers, knobs):
    traced, real = _compare(gpt2_two_layers, Recipe(**knobs))
    assert abs(traced - real) <= 0.01 * real, (traced, real)
