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
from vramplan.measurement.run import cpu_peak_of  # noqa: E402
from vramplan.pipeline import estimate_built  # noqa: E402
from vramplan.recipe import Recipe  # noqa: E402
from vramplan.result import Component  # noqa: E402
from vramplan.sources.keras_models import KerasBuild, import_keras, keras_source  # noqa: E402

keras = import_keras()
T, V, D, HEADS, FF, C = 16, 200, 32, 2, 64, 5


def transformer():
    """A one-block functional transformer (embedding, attention, feed-forward, head)."""
    x = keras.Input((T,), dtype="int32")
    h = keras.layers.Embedding(V, D)(x)
    h = keras.layers.LayerNormalization()(
        h + keras.layers.MultiHeadAttention(HEADS, D // HEADS)(h, h)
    )
    f = keras.layers.Dense(D)(keras.layers.Dense(FF, activation="relu")(h))
    h = keras.layers.LayerNormalization()(h + f)
    return keras.Model(x, keras.layers.Dense(C)(keras.layers.GlobalAveragePooling1D()(h)))


def _real_fit_peak(batch: int) -> int:
    x = torch.randint(0, V, (2 * batch, T))
    y = torch.randint(0, C, (2 * batch,))

    def fit() -> None:
        model = transformer()
        model.compile(optimizer=keras.optimizers.Adam(), loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)

    gc.collect()  # earlier tests' garbage must not be freed inside the profile
    return cpu_peak_of(fit)[0]


@pytest.mark.parametrize("batch", [4, 64])
def test_traced_step_matches_real_model_fit(batch):
    """Batch 4: the parameters dominate and the peak is Keras's Adam update (its foreach
    temporaries); batch 64: the activations dominate, with the last step's gradients alive
    through the forward pass."""
    recipe = Recipe(batch_size=batch, optimizer="adam")
    built = keras_source(keras, KerasBuild(keras, None)(transformer), recipe, "keras")
    estimate = estimate_built(built, recipe, "cpu")
    real = _real_fit_peak(batch)
    assert abs(estimate.peak.allocated_bytes / real - 1) <= 0.03
    # Keras's Adam keeps a momentum and a velocity per weight (and nothing else that large)
    weights = sum(4 * math.prod(w.shape) for w in built.model.trainable_weights)
    assert estimate.components[Component.OPTIMIZER_STATE] == 2 * weights


def test_tensorflow_max_batch_is_judged_by_tensorflow_memory(tmp_path):
    """With a memory limit, the largest batch is the one TensorFlow's allocator fits in it,
    not the one PyTorch's caching allocator fits on the card."""
    factory = tmp_path / "net.py"
    factory.write_text(
        "import keras\n"
        "def make():\n"
        "    x = keras.Input((1024,))\n"
        "    h = keras.layers.Dense(4096, activation='relu')(x)\n"
        "    return keras.Model(x, keras.layers.Dense(10)(h))\n"
    )
    model = f"keras:{factory}:make"
    limited = Session(model, gpu="a100-40gb", framework="tensorflow", tf_memory_limit="256MiB")
    found = limited.max_batch(batch_size=64)
    fits, beyond = found.estimate.details["tensorflow"], found.beyond.details["tensorflow"]
    assert fits["fits"] and not beyond["fits"]
    assert found.estimate.verdict.status == "fits" and found.beyond.verdict.status != "fits"
    unlimited = Session(model, gpu="a100-40gb").max_batch(batch_size=64)
    assert unlimited.value > 4 * found.value
