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
from rich.console import Console

if importlib.util.find_spec("keras") is None:
    pytest.skip("keras is not installed", allow_module_level=True)

from vramplan import Session  # noqa: E402
from vramplan.device.catalog import lookup_gpu  # noqa: E402
from vramplan.errors import UserError  # noqa: E402
from vramplan.pipeline import estimate_built, model_info  # noqa: E402
from vramplan.recipe import Recipe  # noqa: E402
from vramplan.report.terminal import render_estimate  # noqa: E402
from vramplan.sources import resolve  # noqa: E402
from vramplan.sources.keras_models import (  # noqa: E402
    KerasBuild,
    import_keras,
    keras_source,
    scales_loss,
)

keras = import_keras()

from benchmarks.keras_vs_torch import CASES, B, D, T, twin_estimate  # noqa: E402
from benchmarks.keras_vs_torch import keras_estimate as keras_estimate_of  # noqa: E402

keras_cnn = CASES[0].keras_factory


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


def test_keras_cnn_bill_matches_pytorch():
    case = CASES[0]  # channels first: Keras's torch backend runs the convolutions as they are
    keras_estimate, torch_estimate = keras_estimate_of(case), twin_estimate(case, same_way=False)
    assert keras_estimate.model.parameters == torch_estimate.model.parameters
    ratio = keras_estimate.peak.allocated_bytes / torch_estimate.peak.allocated_bytes
    assert abs(ratio - 1) <= 0.05
    keras_parts, torch_parts = dict(keras_estimate.components), dict(torch_estimate.components)
    # the peak is the backward pass's: only the optimizers' scalars (Keras's bias-correction
    # factors, torch's step counts) differ among the temporaries
    assert abs(keras_parts.pop("temporaries") - torch_parts.pop("temporaries")) <= 64
    assert keras_parts == torch_parts


@pytest.mark.parametrize("case", CASES[2:], ids=lambda case: case.label)
def test_keras_transformer_bill_matches_pytorch_computed_the_same_way(case):
    """Within 5% of the twin that computes the block as Keras's torch backend does
    (benchmarks/keras_vs_torch.py ``EinsumBlock``: einsum projections, q/k/v made
    contiguous before SDPA, the output projected by einsum; a functional model's layer
    outputs kept through the forward pass; gradients cleared after the next forward pass).
    The twin written with nn.Linear and SDPA on views keeps less, by an exact amount: its
    SDPA output is laid out (B, T, N, H), so the transpose back is a view, where Keras's
    contiguous q makes it (B, N, T, H) and the output einsum copies the transposed operand
    (one B x T x D fp32 tensor per block, kept by autograd)."""
    keras_estimate = keras_estimate_of(case)
    same_way = twin_estimate(case, same_way=True)
    assert keras_estimate.model.parameters == same_way.model.parameters
    assert abs(keras_estimate.peak.allocated_bytes / same_way.peak.allocated_bytes - 1) <= 0.05
    for part in ("parameters", "optimizer_state", "inputs"):
        assert keras_estimate.components[part] == same_way.components[part]
    if case.label.endswith("subclassed"):  # both peak in the backward pass
        plain = twin_estimate(case, same_way=False)
        einsum_copies = 2 * B * T * D * 4
        assert same_way.peak.allocated_bytes - plain.peak.allocated_bytes == einsum_copies


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


def dense_factory(tmp_path, compile_line: str = ""):
    """A factory file ``net.py:make`` building Input(8) -> Dense(4), then ``compile_line``."""
    factory = tmp_path / "net.py"
    factory.write_text(
        "import keras\n"
        "def make():\n"
        "    x = keras.Input((8,))\n"
        "    model = keras.Model(x, keras.layers.Dense(4)(x))\n"
        + compile_line
        + "    return model\n"
    )
    return factory


def test_compiled_optimizer_is_named_in_the_notes(tmp_path):
    factory = dense_factory(
        tmp_path, "    model.compile(optimizer=keras.optimizers.SGD(momentum=0.9), loss='mse')\n"
    )
    built = resolve(f"keras:{factory}:make", Recipe(batch_size=4, optimizer="adam"))
    assert any("--optimizer momentum" in note for note in built.notes)


@pytest.mark.parametrize(
    ("compile_line", "scaled"),
    [
        ("", True),  # model.fit would compile it under its policy: Keras's default wraps
        ("    model.compile(optimizer='adam', loss='mse')\n", True),
        ("    model.compile(optimizer='adam', loss='mse', auto_scale_loss=False)\n", False),
    ],
)
def test_loss_scaling_follows_model_compile(tmp_path, compile_line, scaled):
    """A LossScaleOptimizer steps the trace exactly when ``model.compile`` makes one: the
    mixed_float16 policy with ``auto_scale_loss`` left on; the optimizer inside it names
    the state (no note that --optimizer differs from the compiled one)."""
    factory = dense_factory(tmp_path, compile_line)
    recipe = Recipe(batch_size=4, optimizer="adam", precision="amp-fp16")
    built = resolve(f"keras:{factory}:make", recipe)
    assert scales_loss(built.model) is scaled
    assert not any("this estimate used --optimizer" in note for note in built.notes)
    with torch.device("meta"):
        params = list(built.model.parameters())
    stepped = built.make_optimizer(params, recipe).keras_optimizer
    assert isinstance(stepped, keras.optimizers.LossScaleOptimizer) is scaled


def test_jit_compile_on_the_torch_backend_is_torch_compile(tmp_path):
    """Keras's torch backend runs ``jit_compile=True`` under torch.compile, not XLA
    (keras/src/backend/torch/trainer.py); the note says so."""
    factory = dense_factory(
        tmp_path, "    model.compile(optimizer='adam', loss='mse', jit_compile=True)\n"
    )
    built = resolve(f"keras:{factory}:make", Recipe(batch_size=4, optimizer="adam"))
    assert any("torch.compile" in note and "XLA" not in note for note in built.notes)


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
    # what is TensorFlow's and what is emulated, said where the figures are
    assert any(note.startswith("TensorFlow emulated") for note in default.notes)
    assert any("jit_compile='auto'" in note and "XLA" in note for note in default.notes)
    console = Console(record=True, width=300)
    render_estimate(default, console=console)
    assert "Peak reserved (PyTorch's caching allocator)" in console.export_text()
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
