"""Keras 3 models traced on Keras's torch backend (sources/keras_models.py) and TensorFlow's
runtime on the card (device/tensorflow.py).

Ground truth: Keras's own ``count_params()``; the same architecture written in PyTorch,
traced the same way; TensorFlow's documented memory-limit arithmetic."""

from __future__ import annotations

import importlib.util
import json
import math
import zipfile

import pytest
import torch
from torch import nn
from torch.nn import functional as F

if importlib.util.find_spec("keras") is None:
    pytest.skip("keras is not installed", allow_module_level=True)

from vramplan import Session  # noqa: E402
from vramplan.device.catalog import lookup_gpu  # noqa: E402
from vramplan.errors import UserError  # noqa: E402
from vramplan.pipeline import estimate_built, model_info  # noqa: E402
from vramplan.recipe import Recipe  # noqa: E402
from vramplan.sources import resolve  # noqa: E402
from vramplan.sources.keras_models import KerasBuild, import_keras, keras_source  # noqa: E402
from vramplan.sources.user_code import module_source  # noqa: E402

keras = import_keras()


def _write_keras_file(path, model) -> None:
    """A .keras zip holding only the architecture (config.json), as model.save writes it."""
    config = keras.saving.serialize_keras_object(model)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("config.json", json.dumps(config))


@pytest.mark.parametrize("name", ["ResNet50", "MobileNetV2", "EfficientNetB0"])
def test_application_parameters_equal_count_params(name, tmp_path):
    """Built from the architecture in a .keras file's config (keras:NAME builds the same)."""
    reference = KerasBuild(keras, None)(lambda: getattr(keras.applications, name)(weights=None))
    path = tmp_path / f"{name}.keras"
    _write_keras_file(path, reference)
    built = resolve(f"keras:{path}", Recipe(batch_size=2))
    info = model_info(built.model, built.name, built.architecture, built.kind)
    assert info.parameters == reference.count_params()
    assert info.trainable_parameters == sum(math.prod(w.shape) for w in reference.trainable_weights)
    assert built.default_input_shape == (224, 224, 3)


def test_application_by_name():
    built = resolve("keras:MobileNetV2", Recipe(batch_size=2))
    info = model_info(built.model, built.name, built.architecture, built.kind)
    assert info.parameters == 3_538_984  # the Keras Applications table's 3.5M


# -- the same architecture in Keras and in PyTorch ---------------------------------------

B, C, V, D, HEADS, HEAD_DIM, FF, T = 16, 10, 1000, 64, 4, 16, 128, 64


def keras_cnn():
    x = keras.Input((3, 32, 32))
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu", data_format="channels_first")(
        x
    )
    h = keras.layers.Conv2D(64, 3, padding="same", activation="relu", data_format="channels_first")(
        h
    )
    h = keras.layers.GlobalAveragePooling2D(data_format="channels_first")(h)
    return keras.Model(x, keras.layers.Dense(C)(h))


class TorchCnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 32, 3, padding=1)
        self.c2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc = nn.Linear(64, C)

    def forward(self, x):
        h = torch.relu(self.c2(torch.relu(self.c1(x))))
        return self.fc(h.mean((2, 3)))


class KerasBlock(keras.layers.Layer):
    def __init__(self):
        super().__init__()
        self.attention = keras.layers.MultiHeadAttention(HEADS, HEAD_DIM)
        self.norm1 = keras.layers.LayerNormalization()
        self.up = keras.layers.Dense(FF, activation="relu")
        self.down = keras.layers.Dense(D)
        self.norm2 = keras.layers.LayerNormalization()

    def call(self, h):
        h = self.norm1(h + self.attention(h, h))
        return self.norm2(h + self.down(self.up(h)))


class KerasTransformer(keras.Model):
    def __init__(self):
        super().__init__()
        self.embed = keras.layers.Embedding(V, D)
        self.blocks = [KerasBlock(), KerasBlock()]
        self.pool = keras.layers.GlobalAveragePooling1D()
        self.head = keras.layers.Dense(C)

    def call(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.pool(h))


def keras_transformer():
    model = KerasTransformer()
    model(keras.ops.zeros((1, T), dtype="int32"))  # builds every layer (on the meta device)
    return model


class TorchBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(D, HEADS * HEAD_DIM) for _ in range(3))
        self.o = nn.Linear(HEADS * HEAD_DIM, D)
        self.norm1 = nn.LayerNorm(D, eps=1e-3)
        self.up, self.down = nn.Linear(D, FF), nn.Linear(FF, D)
        self.norm2 = nn.LayerNorm(D, eps=1e-3)

    def forward(self, h):
        q, k, v = (
            m(h).view(B, T, HEADS, HEAD_DIM).transpose(1, 2) for m in (self.q, self.k, self.v)
        )
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, D)
        h = self.norm1(h + self.o(attended))
        return self.norm2(h + self.down(torch.relu(self.up(h))))


class TorchTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.Sequential(TorchBlock(), TorchBlock())
        self.head = nn.Linear(D, C)

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)).mean(1))


def _bills(keras_factory, torch_class, shape):
    recipe = Recipe(batch_size=B, optimizer="adam", input_shape=shape)
    built = keras_source(keras, KerasBuild(keras, None)(keras_factory), recipe, "keras")
    keras_estimate = estimate_built(built, recipe, "cpu")
    with torch.device("meta"):
        twin = torch_class()
    torch_estimate = estimate_built(module_source(twin, recipe, "torch"), recipe, "cpu")
    assert keras_estimate.model.parameters == torch_estimate.model.parameters
    return keras_estimate, torch_estimate


def test_keras_cnn_bill_matches_pytorch():
    keras_estimate, torch_estimate = _bills(keras_cnn, TorchCnn, (3, 32, 32))
    ratio = keras_estimate.peak.allocated_bytes / torch_estimate.peak.allocated_bytes
    assert abs(ratio - 1) <= 0.05
    keras_parts, torch_parts = dict(keras_estimate.components), dict(torch_estimate.components)
    # the peak is the backward pass's: only the optimizers' scalars (Keras's bias-correction
    # factors, torch's step counts) differ among the temporaries
    assert abs(keras_parts.pop("temporaries") - torch_parts.pop("temporaries")) <= 64
    assert keras_parts == torch_parts


def test_keras_transformer_bill_near_pytorch():
    """Within 10%, not 5%: in Keras's attention block an einsum copies a permuted operand
    into torch.einsum's batched-matmul layout (aten::einsum > reshape > clone in PyTorch's
    profiler) and autograd keeps the copy: one B x T x D tensor per block more than the
    twin (benchmarks/results/2026-11-23-keras.md). A real Keras run keeps it too
    (test_keras_ground_truth.py)."""
    keras_estimate, torch_estimate = _bills(keras_transformer, TorchTransformer, (T,))
    ratio = keras_estimate.peak.allocated_bytes / torch_estimate.peak.allocated_bytes
    assert 1 <= ratio <= 1.10
    for part in ("parameters", "optimizer_state", "inputs"):
        assert keras_estimate.components[part] == torch_estimate.components[part]


# -- precision policies, optimizers, refusals --------------------------------------------


def test_mixed_policy_keeps_fp32_variables_and_half_compute():
    recipe = Recipe(batch_size=B, input_shape=(3, 32, 32), precision="amp-fp16")
    built = keras_source(keras, KerasBuild(keras, "mixed_float16")(keras_cnn), recipe, "keras")
    assert {p.dtype for p in built.model.parameters()} == {torch.float32}
    mixed = estimate_built(built, recipe, "cpu")
    fp32 = estimate_built(
        keras_source(keras, KerasBuild(keras, None)(keras_cnn), Recipe(batch_size=B), "k"),
        Recipe(batch_size=B),
        "cpu",
    )
    # fp16 activations: each saved conv output is half the bytes
    assert mixed.components["activations"] < 0.75 * fp32.components["activations"]
    assert any("mixed_float16" in note for note in mixed.notes)


def test_compiled_optimizer_is_named_in_the_notes(tmp_path):
    factory = tmp_path / "net.py"
    factory.write_text(
        "import keras\n"
        "def make():\n"
        "    x = keras.Input((8,))\n"
        "    model = keras.Model(x, keras.layers.Dense(4)(x))\n"
        "    model.compile(optimizer=keras.optimizers.SGD(momentum=0.9), loss='mse')\n"
        "    return model\n"
    )
    built = resolve(f"keras:{factory}:make", Recipe(batch_size=4, optimizer="adam"))
    assert any("--optimizer momentum" in note for note in built.notes)


def test_custom_objects_are_refused_unless_allowed(tmp_path):
    config = {"module": "my_layers", "class_name": "Block", "config": {}}
    path = tmp_path / "custom.keras"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("config.json", json.dumps(config))
    with pytest.raises(UserError, match="--allow-custom-objects"):
        resolve(f"keras:{path}", Recipe())
    with pytest.raises(UserError, match="building"):  # allowed, and then my_layers is absent
        resolve(f"keras:{path}", Recipe(), allow_custom_objects=True)


def test_unknown_application_is_one_line():
    with pytest.raises(UserError, match="did you mean ResNet50"):
        resolve("keras:ResNet5", Recipe())


# -- TensorFlow's runtime ---------------------------------------------------------------


def test_tensorflow_preallocates_the_card_and_growth_takes_the_need(tmp_path):
    factory = tmp_path / "net.py"
    factory.write_text(
        "import keras\n"
        "def make():\n"
        "    x = keras.Input((256,))\n"
        "    return keras.Model(x, keras.layers.Dense(10)(keras.layers.Dense(512)(x)))\n"
    )
    model = f"keras:{factory}:make"
    default = Session(model, gpu="a100-40gb", framework="tensorflow").estimate(batch_size=32)
    growth = Session(model, gpu="a100-40gb", framework="tensorflow", tf_memory_growth=True)
    grown = growth.estimate(batch_size=32)
    tf, tf_growth = default.details["tensorflow"], grown.details["tensorflow"]
    card = lookup_gpu("a100-40gb").total_bytes
    available = card - tf["runtime_bytes"]
    # gpu_device.cc: the limit is the free memory less 1536 MiB on compute capability 8.x,
    # and without growth the first region is the whole limit
    assert tf["memory_limit_bytes"] == available - 1536 * 2**20
    assert tf["takes_bytes"] == tf["runtime_bytes"] + tf["memory_limit_bytes"]
    assert tf_growth["takes_bytes"] == tf_growth["needs_bytes"] == tf["needs_bytes"]
    assert tf["peak_bytes"] < tf["needs_bytes"] - tf["runtime_bytes"] < 4 * tf["peak_bytes"]
    assert tf_growth["needs_bytes"] < tf["takes_bytes"] / 10
    assert any("preallocates" in note for note in default.notes)
    limited = Session(model, gpu="a100-40gb", framework="tensorflow", tf_memory_limit="1GiB")
    assert limited.estimate(batch_size=32).details["tensorflow"]["takes_bytes"] == (
        tf["runtime_bytes"] + 2**30
    )


def test_a_file_that_is_not_a_keras_zip_is_one_line(tmp_path):
    path = tmp_path / "model.keras"
    path.write_text("not a zip")
    with pytest.raises(UserError, match="not a Keras 3 .keras file"):
        resolve(f"keras:{path}", Recipe())
    assert path.read_text() == "not a zip"


def test_dropout_and_build_time_constants_trace_under_a_mixed_policy():
    """Dropout (seeded from a variable's value on the torch backend) and Normalization's
    mean and variance (kept outside its variables, cast to fp16 at build) both run; the
    variables stay fp32."""

    def net():
        x = keras.Input((8,))
        h = keras.layers.Normalization(mean=0.5, variance=2.0)(x)
        h = keras.layers.Dropout(0.5)(keras.layers.Dense(16)(h))
        return keras.Model(x, keras.layers.Dense(4)(h))

    recipe = Recipe(batch_size=4, precision="amp-fp16", optimizer="sgd")
    reference = KerasBuild(keras, "mixed_float16")(net)
    built = keras_source(keras, KerasBuild(keras, "mixed_float16")(net), recipe, "keras")
    estimate = estimate_built(built, recipe, "cpu")
    trainable = sum(math.prod(w.shape) for w in reference.trainable_weights)
    assert estimate.model.trainable_parameters == trainable == 8 * 16 + 16 + 16 * 4 + 4
    assert estimate.model.parameters == reference.count_params()
    assert estimate.model.parameter_bytes == 4 * reference.count_params()
