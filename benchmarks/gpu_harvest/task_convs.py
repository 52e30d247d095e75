"""The convolution configurations of the task rows (detection, segmentation, video,
diffusion, timm CNNs), read off vramplan's own traces on the CPU: the cuDNN calls the
estimate looks up in a measured table, so a harvest that runs them measures exactly what
those estimates need (the study's CNNs cover 224x224 classification only). Written once
here, committed, and run by ``python -m benchmarks.gpu_harvest`` after its other cases::

    python -m benchmarks.gpu_harvest.task_convs --out benchmarks/gpu_harvest/task_convs.json

    >>> from vramplan.device.cudnn import ConvCase
    >>> case = ConvCase("forward", "float32", "contiguous", (8, 64, 16, 56, 56),
    ...                 (64, 64, 3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1), 1)
    >>> config_of(case)["input"], config_of(case)["dtype"]
    ([8, 64, 16, 56, 56], 'float32')
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.gpu_harvest.task_rows import TASK_ROWS

TASK_CONVS = Path(__file__).with_name("task_convs.json")
CONV_SOURCES = ("torchvision:", "timm:", "diffusers:")


def config_of(case) -> dict:
    """A ``conv_shapes``-style configuration of one traced cuDNN call, with its dtype."""
    return {
        "input": list(case.input),
        "weight": list(case.weight),
        "stride": list(case.stride),
        "padding": list(case.padding),
        "dilation": list(case.dilation),
        "groups": int(case.groups),
        "dtype": case.dtype,
    }


def recipe_of(model: str, args: tuple[str, ...]):
    """The Recipe ``vramplan measure MODEL ARGS`` runs, parsed by the command itself.

    >>> recipe_of("torchvision:r3d_18", ("-b", "4", "--frames", "8", "-o", "sgd")).frames
    8
    """
    import typer

    from vramplan.cli import _register_commands, app
    from vramplan.cli.options import recipe_from_options

    _register_commands()
    measure = typer.main.get_command(app).commands["measure"]
    return recipe_from_options(measure.make_context("measure", [model, *args]).params)


def traced_configs(model: str, args: tuple[str, ...]) -> list[dict]:
    """The distinct forward convolutions of one row's traced step (transposed ones left
    out: the harvest runs ``aten.convolution`` forward and its two backward passes)."""
    from vramplan.device.cudnn import cases_of
    from vramplan.device.options import device_options
    from vramplan.pipeline import cuda_policy, traced
    from vramplan.sources import resolve

    recipe = recipe_of(model, args)
    device = device_options(gpu="h200")
    trace = traced(resolve(model, recipe), recipe, cuda_policy(device))
    found = {}
    for marker in trace.markers:
        for case in cases_of(marker):
            if case.pass_ == "forward" and not case.transposed:
                config = config_of(case)
                found.setdefault(json.dumps(config, sort_keys=True), config)
    return list(found.values())


def task_configs() -> list[dict]:
    """Every convolution row's configurations, the first of each with the rows using it."""
    merged: dict[str, dict] = {}
    for row in TASK_ROWS:
        if not row.model.startswith(CONV_SOURCES):
            continue
        for config in traced_configs(row.model, row.args):
            key = json.dumps(config, sort_keys=True)
            merged.setdefault(key, {**config, "models": []})["models"].append(row.name)
    return list(merged.values())


def load_task_configs(path: Path = TASK_CONVS) -> list[dict]:
    return json.loads(path.read_text()) if path.exists() else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=TASK_CONVS)
    options = parser.parse_args(argv)
    configs = task_configs()
    options.out.write_text(json.dumps(configs, indent=0) + "\n")
    print(f"{len(configs)} configurations -> {options.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
