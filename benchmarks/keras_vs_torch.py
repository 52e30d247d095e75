"""Keras on its torch backend vs the same architecture in PyTorch: the allocated peak of
each, traced the same way (target cpu), and their ratio (prints only). Two twins: the
one a PyTorch user writes (nn.Linear, SDPA on transposed views) and the one computed as
Keras computes it (einsum projections, contiguous q/k/v, a functional model's layer
outputs kept through the forward pass, gradients cleared after the next forward pass).

PYTHONPATH=src python benchmarks/keras_vs_torch.py
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe
from vramplan.result import Estimate
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


class ChannelsLastCnn(nn.Module):
    """The channels-last CNN as Keras's torch backend computes it
    (keras/src/backend/torch/nn.py ``conv``): the (B, H, W, C) input permuted to
    channels-first and made contiguous, then made channels-last in memory again, the
    (kh, kw, in, out) kernel permuted likewise, the output permuted back; then the bias
    added and the activation (keras/src/layers/convolutional/base_conv.py)."""

    def __init__(self):
        super().__init__()
        self.kernels = nn.ParameterList(
            nn.Parameter(torch.empty(3, 3, n_in, n_out)) for n_in, n_out in ((3, 32), (32, 64))
        )
        self.biases = nn.ParameterList(nn.Parameter(torch.empty(n)) for n in (32, 64))
        self.fc = nn.Linear(64, C)

    def forward(self, x):
        for kernel, bias in zip(self.kernels, self.biases, strict=True):
            x = x.permute(0, 3, 1, 2).contiguous().contiguous(memory_format=torch.channels_last)
            weight = kernel.permute(3, 2, 0, 1).contiguous(memory_format=torch.channels_last)
            x = torch.relu(F.conv2d(x, weight, padding=1).permute(0, 2, 3, 1) + bias)
        return self.fc(x.mean((1, 2)))


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


class EinsumBlock(nn.Module):
    """The block as Keras computes it on its torch backend, written in torch: EinsumDense
    projections (``torch.einsum`` then a separate bias add; keras/src/layers/core/
    einsum_dense.py), q, k and v transposed to (B, N, T, H) and made contiguous before
    SDPA, the output transposed back and projected by einsum ``abcd,cde->abe``
    (keras/src/backend/torch/nn.py ``dot_product_attention``; keras/src/layers/attention/
    multi_head_attention.py), Dense as matmul then bias add."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.ParameterList(nn.Parameter(torch.empty(D, HEADS, HEAD_DIM)) for _ in range(3))
        self.qkv_bias = nn.ParameterList(
            nn.Parameter(torch.empty(HEADS, HEAD_DIM)) for _ in range(3)
        )
        self.o, self.o_bias = (
            nn.Parameter(torch.empty(HEADS, HEAD_DIM, D)),
            nn.Parameter(torch.empty(D)),
        )
        self.up, self.up_bias = nn.Parameter(torch.empty(D, FF)), nn.Parameter(torch.empty(FF))
        self.down, self.down_bias = nn.Parameter(torch.empty(FF, D)), nn.Parameter(torch.empty(D))
        self.norm1, self.norm2 = nn.LayerNorm(D, eps=1e-3), nn.LayerNorm(D, eps=1e-3)

    def forward(self, h, kept: list | None = None):
        """``kept``: a list that holds each Keras layer's output, as a functional model's
        graph does until its forward pass returns (keras/src/ops/function.py)."""

        def layer(output):
            if kept is not None:
                kept.append(output)
            return output

        q, k, v = (
            (torch.einsum("abc,cde->abde", h, w) + b).transpose(1, 2).contiguous()
            for w, b in zip(self.qkv, self.qkv_bias, strict=True)
        )
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
        # nested calls, as Keras's block writes them: no local holds a layer's output
        h = layer(
            self.norm1(
                layer(h + layer(torch.einsum("abcd,cde->abe", attended, self.o) + self.o_bias))
            )
        )
        up = layer(torch.relu(torch.matmul(h, self.up) + self.up_bias))
        return layer(self.norm2(layer(h + layer(torch.matmul(up, self.down) + self.down_bias))))


class TorchTransformer(nn.Module):
    def __init__(self, block=TorchBlock):
        super().__init__()
        self.embed, self.blocks = nn.Embedding(V, D), nn.Sequential(block(), block())
        self.head = nn.Linear(D, C)

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)).mean(1))


class EinsumTransformer(TorchTransformer):
    """The transformer with Keras's block computation (``EinsumBlock``); ``functional``:
    every layer's output kept until the forward pass returns, as Keras's functional
    graph keeps it."""

    def __init__(self, functional: bool = False):
        super().__init__(EinsumBlock)
        self.functional = functional

    def forward(self, x):
        kept = [] if self.functional else None
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, kept)
        return self.head(h.mean(1))


class Case(NamedTuple):
    """One Keras model and its PyTorch twins."""

    label: str
    keras_factory: Callable[[], Any]
    twin: Callable[[], nn.Module]
    """The architecture as a PyTorch user writes it (nn.Linear, SDPA on views)."""
    twin_shape: tuple[int, ...]
    keras_shape: tuple[int, ...] | None
    """The Keras input shape when the model has no keras.Input."""
    same_way: Callable[[], nn.Module]
    """The twin computed as Keras computes it (``EinsumBlock``; a functional model's layer
    outputs kept through the forward pass), traced in Keras's step order."""
    same_way_shape: tuple[int, ...] | None = None
    """Its input shape, where not ``twin_shape`` (channels last)."""


CASES = [
    Case(
        "CNN, channels first",
        lambda: keras_cnn("channels_first"),
        TorchCnn,
        (3, 32, 32),
        None,
        TorchCnn,
    ),
    Case(
        "CNN, channels last",
        lambda: keras_cnn("channels_last"),
        TorchCnn,
        (3, 32, 32),
        None,
        ChannelsLastCnn,
        (32, 32, 3),
    ),
    Case(
        "transformer, subclassed",
        keras_subclassed_transformer,
        TorchTransformer,
        (T,),
        (T,),
        EinsumTransformer,
    ),
    Case(
        "transformer, functional",
        keras_functional_transformer,
        TorchTransformer,
        (T,),
        None,
        lambda: EinsumTransformer(functional=True),
    ),
]


def keras_estimate(case: Case, zero_grad_after_forward: bool = True) -> Estimate:
    """The traced step of the Keras model (``False``: gradients cleared after the optimizer
    step instead of after the next forward pass, as Keras's ``train_step`` does)."""
    recipe = Recipe(batch_size=B, optimizer="adam", input_shape=case.keras_shape)
    built = keras_source(keras, KerasBuild(keras, None)(case.keras_factory), recipe, case.label)
    built = dataclasses.replace(built, zero_grad_after_forward=zero_grad_after_forward)
    return estimate_built(built, recipe, "cpu")


def twin_estimate(case: Case, same_way: bool) -> Estimate:
    """The traced step of a twin: ``case.same_way`` in Keras's step order (gradients
    cleared after the next forward pass, as Keras's ``train_step`` does) or ``case.twin``
    in PyTorch's (after the optimizer step)."""
    factory, shape = case.twin, case.twin_shape
    if same_way:
        factory, shape = case.same_way, case.same_way_shape or case.twin_shape
    recipe = Recipe(batch_size=B, optimizer="adam", input_shape=shape)
    with torch.device("meta"):
        twin = factory()
    built = dataclasses.replace(
        module_source(twin, recipe, "torch"), zero_grad_after_forward=same_way
    )
    return estimate_built(built, recipe, "cpu")


def main() -> None:
    print(f"{'case':<26} {'keras':>11} {'same way':>11} {'ratio':>6} {'nn twin':>11} {'ratio':>6}")
    for case in CASES:
        traced = keras_estimate(case).peak.allocated_bytes
        same = twin_estimate(case, same_way=True).peak.allocated_bytes
        plain = twin_estimate(case, same_way=False).peak.allocated_bytes
        print(
            f"{case.label:<26} {traced:>11,} {same:>11,} {traced / same:>6.3f} "
            f"{plain:>11,} {traced / plain:>6.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
