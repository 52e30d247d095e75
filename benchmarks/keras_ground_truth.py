"""The traced Keras step against a real ``model.fit`` of the same model on the CPU (Keras's
torch backend), measured with PyTorch's profiler over the whole run (the model's build,
compile and two training steps), beside the PyTorch twin's trace (prints only).

PYTHONPATH=src python benchmarks/keras_ground_truth.py
"""

from __future__ import annotations

import dataclasses
import gc
import json
import subprocess
import sys

import torch
from keras_vs_torch import CASES, B, C, keras

from vramplan.measurement.run import cpu_peak_of
from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe
from vramplan.sources.keras_models import KerasBuild, keras_source
from vramplan.sources.user_code import module_source


def fit_peak(factory, shape: tuple[int, ...] | None, integer: bool) -> int:
    """Peak live tensor bytes of ``model.fit`` over two batches, from the profiler (the
    data set itself is made before profiling starts; the batches fit slices from it are
    counted)."""
    model = factory()
    size = shape or tuple(model.inputs[0].shape[1:])
    del model
    x = torch.randint(0, 2, (2 * B, *size)) if integer else torch.randn(2 * B, *size)
    y = torch.randint(0, C, (2 * B,))

    def run() -> None:
        model = factory()
        model.compile(optimizer=keras.optimizers.Adam(), loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=B, epochs=1, verbose=0, shuffle=False)

    gc.collect()
    return cpu_peak_of(run)[0]


def fit_peak_alone(label: str, gc_mode: str) -> int:
    """``fit_peak`` in a fresh process: frees of an earlier run's garbage would show as
    negative allocations in this one's profile."""
    command = [sys.executable, __file__, "--real", label, gc_mode]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def traced(factory, shape: tuple[int, ...] | None, after_forward: bool) -> int:
    recipe = Recipe(batch_size=B, optimizer="adam", input_shape=shape)
    built = keras_source(keras, KerasBuild(keras, None)(factory), recipe, "keras")
    built = dataclasses.replace(built, zero_grad_after_forward=after_forward)
    return estimate_built(built, recipe, "cpu").peak.allocated_bytes


def twin(torch_class, shape: tuple[int, ...]) -> int:
    recipe = Recipe(batch_size=B, optimizer="adam", input_shape=shape)
    with torch.device("meta"):
        model = torch_class()
    return estimate_built(module_source(model, recipe, "torch"), recipe, "cpu").peak.allocated_bytes


def real_main(label: str, gc_mode: str) -> None:
    case = next(case for case in CASES if case[0] == label)
    if gc_mode == "off":
        gc.disable()
    elif gc_mode == "eager":
        gc.set_threshold(1, 1, 1)
    print(json.dumps(fit_peak(case[1], case[4], label.startswith("transformer"))))


def main() -> None:
    print(
        f"{'case':<26} {'model.fit':>11} {'gc off':>11} {'traced':>11} {'ratio':>6} "
        f"{'zero@step':>11} {'ratio':>6} {'twin':>11} {'traced/twin':>11}"
    )
    for label, keras_factory, torch_class, torch_shape, keras_shape in CASES:
        real = fit_peak_alone(label, "on")
        no_gc = fit_peak_alone(label, "off")
        keras_way = traced(keras_factory, keras_shape, True)
        torch_way = traced(keras_factory, keras_shape, False)
        twin_bytes = twin(torch_class, torch_shape)
        print(
            f"{label:<26} {real:>11,} {no_gc:>11,} {keras_way:>11,} {keras_way / real:>6.3f} "
            f"{torch_way:>11,} {torch_way / real:>6.3f} {twin_bytes:>11,} "
            f"{keras_way / twin_bytes:>11.3f}",
            flush=True,
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--real"]:
        real_main(sys.argv[2], sys.argv[3])
    else:
        main()
