"""The traced Keras step against a real ``model.fit`` of the same model on the CPU (Keras's
torch backend), measured with PyTorch's profiler over the whole run (the model's build,
compile and two training steps), beside the PyTorch twins' traces (prints only).

PYTHONPATH=src python benchmarks/keras_ground_truth.py
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import torch
from keras_vs_torch import CASES, B, C, keras, keras_estimate, twin_estimate

from vramplan.measurement.run import cpu_peak_of


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


def real_main(label: str, gc_mode: str) -> None:
    case = next(case for case in CASES if case.label == label)
    if gc_mode == "off":
        gc.disable()
    elif gc_mode == "eager":
        gc.set_threshold(1, 1, 1)
    print(
        json.dumps(fit_peak(case.keras_factory, case.keras_shape, label.startswith("transformer")))
    )


def main() -> None:
    print(
        f"{'case':<26} {'model.fit':>11} {'gc off':>11} {'traced':>11} {'ratio':>6} "
        f"{'zero@step':>11} {'ratio':>6} {'same way':>11} {'ratio':>6} {'nn twin':>11} "
        f"{'ratio':>6}"
    )
    for case in CASES:
        real = fit_peak_alone(case.label, "on")
        no_gc = fit_peak_alone(case.label, "off")
        keras_way = keras_estimate(case).peak.allocated_bytes
        torch_way = keras_estimate(case, zero_grad_after_forward=False).peak.allocated_bytes
        same = twin_estimate(case, same_way=True).peak.allocated_bytes
        plain = twin_estimate(case, same_way=False).peak.allocated_bytes
        print(
            f"{case.label:<26} {real:>11,} {no_gc:>11,} {keras_way:>11,} "
            f"{keras_way / real:>6.3f} {torch_way:>11,} {torch_way / real:>6.3f} "
            f"{same:>11,} {keras_way / same:>6.3f} {plain:>11,} {keras_way / plain:>6.3f}",
            flush=True,
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--real"]:
        real_main(sys.argv[2], sys.argv[3])
    else:
        main()
