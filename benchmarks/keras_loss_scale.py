"""mixed_float16's LossScaleOptimizer: the traced step against a real ``model.fit`` on the
CPU (Keras's torch backend), each real run in a fresh process (prints only).

An MLP whose weights dominate, so the peak is the optimizer update, where the
LossScaleOptimizer's unscaled copy of every gradient lives. "traced" is vramplan's trace
under mixed_float16 (loss scaled, gradients unscaled into copies, Keras's Adam inside);
"mixed_bfloat16" the same model under the policy with no loss scaling (the same 2-byte
compute); "gc off" the real run with Python's cycle collector off.

PYTHONPATH=src python benchmarks/keras_loss_scale.py
"""

from __future__ import annotations

import gc
import json
import math
import subprocess
import sys

import torch

from vramplan.measurement.run import cpu_peak_of
from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe
from vramplan.sources.keras_models import KerasBuild, import_keras, keras_source

keras = import_keras()
IN, HIDDEN, CLASSES = 256, 1024, 10


def mlp():
    x = keras.Input((IN,))
    h = keras.layers.Dense(HIDDEN, activation="relu")(x)
    return keras.Model(x, keras.layers.Dense(CLASSES)(h))


def real_peak(batch: int) -> int:
    """Peak live tensor bytes of ``model.fit`` (two batches) under mixed_float16."""
    keras.config.set_dtype_policy("mixed_float16")
    x, y = torch.randn(2 * batch, IN), torch.randint(0, CLASSES, (2 * batch,))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def fit() -> None:
        model = mlp()
        model.compile(optimizer=keras.optimizers.Adam(), loss=loss)
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)

    gc.collect()
    return cpu_peak_of(fit)[0]


def real_peak_alone(batch: int, gc_mode: str) -> int:
    command = [sys.executable, __file__, "--real", str(batch), gc_mode]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def traced(batch: int, precision: str, policy: str) -> tuple[int, int]:
    """The traced peak and the bytes of the gradients (fp32, as the variables)."""
    recipe = Recipe(batch_size=batch, optimizer="adam", precision=precision)
    built = keras_source(keras, KerasBuild(keras, policy)(mlp), recipe, "mlp")
    gradients = sum(4 * math.prod(w.shape) for w in built.model.trainable_weights)
    return estimate_built(built, recipe, "cpu").peak.allocated_bytes, gradients


def main() -> None:
    print(
        f"{'batch':>5} {'model.fit':>11} {'gc off':>11} {'traced':>11} {'ratio':>6} "
        f"{'bfloat16':>11} {'traced - bf16':>13} {'gradients':>11}"
    )
    for batch in (8, 64):
        real, no_gc = real_peak_alone(batch, "on"), real_peak_alone(batch, "off")
        scaled, gradients = traced(batch, "amp-fp16", "mixed_float16")
        unscaled, _ = traced(batch, "amp-bf16", "mixed_bfloat16")
        print(
            f"{batch:>5} {real:>11,} {no_gc:>11,} {scaled:>11,} {scaled / real:>6.3f} "
            f"{unscaled:>11,} {scaled - unscaled:>13,} {gradients:>11,}",
            flush=True,
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--real"]:
        if sys.argv[3] == "off":
            gc.disable()
        print(json.dumps(real_peak(int(sys.argv[2]))))
    else:
        main()
