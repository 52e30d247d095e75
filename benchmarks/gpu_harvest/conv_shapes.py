"""The unique Conv2d configurations of the study's CNNs, found on the meta device (no weights,
no memory, no GPU): a forward hook on every ``nn.Conv2d`` records the input shape, weight
shape, stride, padding, dilation and groups.

    >>> configs = unique_configs(conv_configs("resnet18", batch=32))    # doctest: +SKIP
    >>> len(configs), configs[0]["input"], configs[0]["weight"]           # doctest: +SKIP
    (11, [32, 3, 224, 224], [64, 3, 7, 7])
"""

from __future__ import annotations

import csv
from pathlib import Path

import torch

MODELS = ("vgg16", "resnet50", "mobilenet_v2", "resnet18")
WORKLOADS = Path(__file__).resolve().parents[1] / "accuracy" / "workloads.csv"


def _pair(value) -> list[int]:
    return [int(v) for v in value] if isinstance(value, (tuple, list)) else [int(value)] * 2


def conv_configs(model_name: str, batch: int, image: tuple[int, int, int] = (3, 224, 224)):
    """Every Conv2d call of torchvision's ``model_name`` on one batch, in call order."""
    import torchvision

    found: list[dict] = []

    def hook(module: torch.nn.Conv2d, args, _output) -> None:
        if isinstance(module.padding, str):  # "same"/"valid": keep what the module resolved
            padding = [int(p) for p in module._reversed_padding_repeated_twice[::2][::-1]]
        else:
            padding = _pair(module.padding)
        found.append(
            {
                "model": model_name,
                "input": [int(d) for d in args[0].shape],
                "weight": [int(d) for d in module.weight.shape],
                "stride": _pair(module.stride),
                "padding": padding,
                "dilation": _pair(module.dilation),
                "groups": int(module.groups),
            }
        )

    with torch.device("meta"):
        model = torchvision.models.get_model(model_name, weights=None)
    handles = [
        m.register_forward_hook(hook) for m in model.modules() if isinstance(m, torch.nn.Conv2d)
    ]
    try:
        model.eval()
        with torch.no_grad():
            model(torch.empty(batch, *image, device="meta"))
    finally:
        for handle in handles:
            handle.remove()
    return found


def shape_key(config: dict) -> tuple:
    return (
        tuple(config["input"]),
        tuple(config["weight"]),
        tuple(config["stride"]),
        tuple(config["padding"]),
        tuple(config["dilation"]),
        config["groups"],
    )


def unique_configs(configs: list[dict]) -> list[dict]:
    """The first of each distinct configuration, in order, with ``models`` naming who uses it."""
    seen: dict[tuple, dict] = {}
    for config in configs:
        key = shape_key(config)
        if key in seen:
            if config["model"] not in seen[key]["models"]:
                seen[key]["models"].append(config["model"])
            continue
        entry = {k: v for k, v in config.items() if k != "model"}
        entry["models"] = [config["model"]]
        seen[key] = entry
    return list(seen.values())


def output_shape(config: dict) -> list[int]:
    """The convolution's output shape [N, K, P, Q] (or [N, K, O, P, Q] in 3-d)."""
    n, k = config["input"][0], config["weight"][0]
    sizes = []
    for size, kernel, stride, pad, dil in zip(
        config["input"][2:],
        config["weight"][2:],
        config["stride"],
        config["padding"],
        config["dilation"],
        strict=True,
    ):
        sizes.append((size + 2 * pad - dil * (kernel - 1) - 1) // stride + 1)
    return [n, k, *sizes]


def study_configs(models=MODELS, batches=(32, 128)) -> list[dict]:
    """Unique configurations of ``models`` at 224x224, for each batch size (batch-major)."""
    out = []
    for batch in batches:
        calls = [c for name in models for c in conv_configs(name, batch)]
        out += unique_configs(calls)
    return out


def workload_configs(path: Path = WORKLOADS) -> list[dict]:
    """Unique configurations of the accuracy study's torchvision CNN workloads, at the
    batch size and image shape each workload runs."""
    import torchvision

    classifiers = set(torchvision.models.list_models(module=torchvision.models))
    calls = []
    with path.open() as handle:
        for row in csv.DictReader(handle):
            name = row["model"].removeprefix("torchvision:")
            if not row["model"].startswith("torchvision:") or name not in classifiers:
                continue
            if not row["input_shape"]:
                continue
            image = tuple(int(d) for d in row["input_shape"].split("x"))
            if len(image) != 3:
                continue
            calls += conv_configs(name, int(row["batch_size"]), image)
    return unique_configs(calls)
