"""Keras on its torch backend vs the same architecture in PyTorch: the allocated peak of
each, traced the same way (target cpu), and their ratio (prints only).

PYTHONPATH=src python benchmarks/keras_vs_torch.py
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe
from vramplan.sources.keras_models import KerasBuild, import_keras, keras_source
from vramplan.sources.user_code import module_source

keras = import_keras()
B, C, V, D, HEADS, HEAD_DIM, FF, T = 16, 10, 1000, 64, 4, 16, 128, 64


def keras_cnn(data_format: str):
    shape = (3, 32, 32) if data_format == "channels_first" else (32, 32, 3)
    x = keras.Input(shape)
    h = x
    for width in (32, 64):
        h = keras.layers.Conv2D(
            width, 3, padding="same", activation="relu", data_format=data_format
        )(h)
    h = keras.layers.GlobalAveragePooling2D(data_format=data_format)(h)
    return keras.Model(x, keras.layers.Dense(C)(h))


class TorchCnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 32, 3, padding=1), nn.Conv2d(32, 64, 3, padding=1)
        self.fc = nn.Linear(64, C)

    def forward(self, x):
        return self.fc(torch.relu(self.c2(torch.relu(self.c1(x)))).mean((2, 3)))


def keras_block(h):
    h = keras.layers.LayerNormalization()(
        h + keras.layers.MultiHeadAttention(HEADS, HEAD_DIM)(h, h)
    )
    f = keras.layers.Dense(D)(keras.layers.Dense(FF, activation="relu")(h))
    return keras.layers.LayerNormalization()(h + f)


def keras_functional_transformer():
    x = keras.Input((T,), dtype="int32")
    h = keras_block(keras_block(keras.layers.Embedding(V, D)(x)))
    return keras.Model(x, keras.layers.Dense(C)(keras.layers.GlobalAveragePooling1D()(h)))


class KerasBlock(keras.layers.Layer):
    def __init__(self):
        super().__init__()
        self.attention = keras.layers.MultiHeadAttention(HEADS, HEAD_DIM)
        self.norm1, self.norm2 = (
            keras.layers.LayerNormalization(),
            keras.layers.LayerNormalization(),
        )
        self.up, self.down = keras.layers.Dense(FF, activation="relu"), keras.layers.Dense(D)

    def call(self, h):
        h = self.norm1(h + self.attention(h, h))
        return self.norm2(h + self.down(self.up(h)))


class KerasTransformer(keras.Model):
    def __init__(self):
        super().__init__()
        self.embed, self.blocks = keras.layers.Embedding(V, D), [KerasBlock(), KerasBlock()]
        self.pool, self.head = keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(C)

    def call(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.pool(h))


def keras_subclassed_transformer():
    model = KerasTransformer()
    model(keras.ops.zeros((1, T), dtype="int32"))
    return model


class TorchBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(D, HEADS * HEAD_DIM) for _ in range(3))
        self.o, self.up, self.down = nn.Linear(D, D), nn.Linear(D, FF), nn.Linear(FF, D)
        self.norm1, self.norm2 = nn.LayerNorm(D, eps=1e-3), nn.LayerNorm(D, eps=1e-3)

    def forward(self, h):
        q, k, v = (m(h).view(B, T, HEADS, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, D)
        h = self.norm1(h + self.o(attended))
        return self.norm2(h + self.down(torch.relu(self.up(h))))


class TorchTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.blocks = nn.Embedding(V, D), nn.Sequential(TorchBlock(), TorchBlock())
        self.head = nn.Linear(D, C)

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)).mean(1))


# (label, Keras factory, PyTorch twin, the twin's input shape, the Keras input shape when
# the model has no keras.Input)
CASES = [
    ("CNN, channels first", lambda: keras_cnn("channels_first"), TorchCnn, (3, 32, 32), None),
    ("CNN, channels last", lambda: keras_cnn("channels_last"), TorchCnn, (3, 32, 32), None),
    ("transformer, subclassed", keras_subclassed_transformer, TorchTransformer, (T,), (T,)),
    ("transformer, functional", keras_functional_transformer, TorchTransformer, (T,), None),
]


def main() -> None:
    print(f"{'case':<26} {'keras bytes':>12} {'torch bytes':>12} {'ratio':>7}")
    for label, keras_factory, torch_class, torch_shape, keras_shape in CASES:
        keras_recipe = Recipe(batch_size=B, optimizer="adam", input_shape=keras_shape)
        built = keras_source(keras, KerasBuild(keras, None)(keras_factory), keras_recipe, label)
        keras_bytes = estimate_built(built, keras_recipe, "cpu").peak.allocated_bytes
        recipe = Recipe(batch_size=B, optimizer="adam", input_shape=torch_shape)
        with torch.device("meta"):
            twin = torch_class()
        torch_bytes = estimate_built(module_source(twin, recipe, "torch"), recipe, "cpu")
        torch_bytes = torch_bytes.peak.allocated_bytes
        print(
            f"{label:<26} {keras_bytes:>12,} {torch_bytes:>12,} {keras_bytes / torch_bytes:>7.3f}"
        )


if __name__ == "__main__":
    main()
