"""The traced Keras step against Keras's own ``model.fit`` run for real on the CPU (its
torch backend), and TensorFlow's runtime judging ``max_batch``.

Ground truth: PyTorch's profiler over a real ``model.fit`` (the model's build, compile and
two training steps; the data set is made before profiling starts), as
``vramplan.measure`` takes a CPU peak. The trace must follow what ``model.fit`` does:
gradients cleared after the forward pass (``keras/src/backend/torch/trainer.py``
``train_step``) and Keras's own optimizer update with its temporaries."""

from __future__ import annotations

import gc
import importlib.util
import math

import pytest
import torch

if importlib.util.find_spec("keras") is None:
    pytest.skip("keras is not installed", allow_module_level=True)

from vramplan import Session  # noqa: E402
from vramplan.errors import UserError  # noqa: E402
from vramplan.measurement.run import cpu_peak_of  # noqa: E402
from vramplan.pipeline import estimate_built  # noqa: E402
from vramplan.recipe import Recipe  # noqa: E402
from vramplan.result import Component  # noqa: E402
from vramplan.sources.keras_models import KerasBuild, import_keras, keras_source  # noqa: E402

keras = import_keras()
T, D, HEADS, FF, C = 16, 32, 2, 64, 5


def transformer(vocab: int):
    """A one-block functional transformer (embedding, attention, feed-forward, head)."""
    x = keras.Input((T,), dtype="int32")
    h = keras.layers.Embedding(vocab, D)(x)
    h = keras.layers.LayerNormalization()(
        h + keras.layers.MultiHeadAttention(HEADS, D // HEADS)(h, h)
    )
    f = keras.layers.Dense(D)(keras.layers.Dense(FF, activation="relu")(h))
    h = keras.layers.LayerNormalization()(h + f)
    return keras.Model(x, keras.layers.Dense(C)(keras.layers.GlobalAveragePooling1D()(h)))


def _real_fit_peak(batch: int, vocab: int) -> int:
    x = torch.randint(0, vocab, (2 * batch, T))
    y = torch.randint(0, C, (2 * batch,))

    def fit() -> None:
        model = transformer(vocab)
        model.compile(optimizer=keras.optimizers.Adam(), loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)

    gc.collect()  # earlier tests' garbage must not be freed inside the profile
    return cpu_peak_of(fit)[0]


@pytest.mark.parametrize(("batch", "vocab"), [(4, 200), (32, 1000)])
def test_traced_step_matches_real_model_fit(batch, vocab):
    """Batch 4: the weights dominate and the peak is Keras's Adam update (its foreach
    temporaries; torch's Adam in its place reads 27% low). Batch 32: the peak is at the end
    of the forward pass, with the last step's gradients still alive (clearing them after
    the optimizer step instead reads 6% low)."""
    recipe = Recipe(batch_size=batch, optimizer="adam")
    built = keras_source(keras, KerasBuild(keras, None)(lambda: transformer(vocab)), recipe, "k")
    estimate = estimate_built(built, recipe, "cpu")
    real = _real_fit_peak(batch, vocab)
    assert abs(estimate.peak.allocated_bytes / real - 1) <= 0.03
    # Keras's Adam keeps a momentum and a velocity per weight (and nothing else that large)
    weights = sum(4 * math.prod(w.shape) for w in built.model.trainable_weights)
    assert estimate.components[Component.OPTIMIZER_STATE] == 2 * weights


def mlp():
    """Weights dominate: the step's peak is the optimizer update."""
    x = keras.Input((256,))
    return keras.Model(x, keras.layers.Dense(C)(keras.layers.Dense(1024, activation="relu")(x)))


def _real_mixed_fit_peak(batch: int) -> int:
    x, y = torch.randn(2 * batch, 256), torch.randint(0, C, (2 * batch,))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def fit() -> None:
        model = mlp()
        model.compile(optimizer=keras.optimizers.Adam(), loss=loss)
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)

    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        gc.collect()
        return cpu_peak_of(fit)[0]
    finally:
        keras.config.set_dtype_policy(previous)


def test_loss_scale_optimizer_matches_real_mixed_float16_fit():
    """Under mixed_float16, ``model.compile`` wraps Adam in a LossScaleOptimizer
    (keras/src/trainers/trainer.py); ``model.fit`` scales the loss, and the update checks
    every gradient for inf/NaN and divides each by the scale into a copy that lives
    through Adam's update (keras/src/optimizers/loss_scale_optimizer.py). The trace
    matches a real ``model.fit`` (without the copies it reads 12% low), and exceeds
    mixed_bfloat16's (the same 2-byte compute, no loss scaling) by one copy of the fp32
    gradients and a few scalars."""
    batch = 8
    fp16 = Recipe(batch_size=batch, optimizer="adam", precision="amp-fp16")
    built = keras_source(keras, KerasBuild(keras, "mixed_float16")(mlp), fp16, "k")
    scaled = estimate_built(built, fp16, "cpu")
    bf16 = Recipe(batch_size=batch, optimizer="adam", precision="amp-bf16")
    unscaled = estimate_built(
        keras_source(keras, KerasBuild(keras, "mixed_bfloat16")(mlp), bf16, "k"), bf16, "cpu"
    )
    gradients = sum(4 * math.prod(w.shape) for w in built.model.trainable_weights)
    extra = scaled.peak.allocated_bytes - unscaled.peak.allocated_bytes
    assert 0 <= extra - gradients <= 64
    assert any("LossScaleOptimizer" in note for note in scaled.notes)
    real = _real_mixed_fit_peak(batch)
    assert abs(scaled.peak.allocated_bytes / real - 1) <= 0.02


def test_tensorflow_max_batch_is_judged_by_tensorflow_memory(tmp_path):
    """With a memory limit, the largest batch is the one TensorFlow's allocator fits in it,
    where PyTorch's caching allocator would call a larger one fitting on the card."""
    factory = tmp_path / "net.py"
    factory.write_text(
        "import keras\n"
        "def make():\n"
        "    x = keras.Input((256,))\n"
        "    h = keras.layers.Dense(1024, activation='relu')(x)\n"
        "    return keras.Model(x, keras.layers.Dense(10)(h))\n"
    )
    model = f"keras:{factory}:make"
    limited = Session(model, gpu="a100-40gb", framework="tensorflow", tf_memory_limit="64MiB")
    found = limited.max_batch(batch_size=512)
    fits, beyond = found.estimate.details["tensorflow"], found.beyond.details["tensorflow"]
    assert fits["fits"] and not beyond["fits"]
    assert found.estimate.verdict.status == "fits" and found.beyond.verdict.status != "fits"
    assert found.beyond.details["tensorflow"]["memory_limit_bytes"] == 64 * 2**20
    pytorch = Session(model, gpu="a100-40gb").estimate(batch_size=found.value + 1)
    assert pytorch.verdict.status == "fits"
    tiny = Session(model, gpu="a100-40gb", framework="tensorflow", tf_memory_limit="1MiB")
    with pytest.raises(UserError, match="runs out within TensorFlow's memory limit of 1,048,576"):
        tiny.max_batch(batch_size=1)
