"""Turn a model name or path into a ``BuiltModel`` without allocating real memory.

>>> resolve("torchvision:resnet50", Recipe(batch_size=8)).kind
'image'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramplan.errors import UserError
from vramplan.recipe import Recipe

if TYPE_CHECKING:
    from vramplan.sources.base import BuiltModel

PREFIXES = ("torchvision", "timm", "hf", "diffusers")


def resolve(
    spec: str,
    recipe: Recipe,
    device: str = "meta",
    trust_remote_code: bool = False,
    allow_custom_objects: bool = False,
) -> BuiltModel:
    """``torchvision:NAME``, ``timm:NAME``, ``hf:NAME`` (or ``hf:path/config.json``), a bare
    hub id ``ORG/NAME``, ``diffusers:NAME`` (a bundled config or ``diffusers:path/config.json``),
    ``keras:NAME|file.keras|file.py:factory``, ``path/to/file.py:factory`` or
    ``package.module:factory``; built on the meta device (for tracing) or, for a real run,
    initialised on ``device``. A Hugging Face repository's own modeling code runs only with
    ``trust_remote_code``; ``allow_custom_objects`` lets a ``.keras`` file's custom classes
    be imported."""
    spec = with_source(spec)
    prefix, sep, rest = spec.partition(":")
    if not sep or not rest:
        raise UserError(
            f"cannot read model {spec!r}: use torchvision:NAME, timm:NAME, hf:NAME, "
            "a hub id ORG/NAME, diffusers:NAME, keras:NAME, path/to/file.py:factory or "
            "package.module:factory"
        )
    if prefix == "keras":
        if device != "meta":
            raise UserError("keras: models are estimated only; measure runs PyTorch models")
        from vramplan.sources.keras_models import build_keras

        return build_keras(rest, recipe, allow_custom_objects)
    if prefix in PREFIXES:
        from vramplan.sources.finetune import apply_finetune

        built = _build_named(prefix, rest, recipe, device, trust_remote_code)
        check_task_options(built, recipe)
        return apply_finetune(built, recipe, device)
    from vramplan.sources.user_code import build_from_factory

    return build_from_factory(spec, recipe, device)


# The options that describe one task's batch, and the model kinds that read them.
TASK_OPTIONS = {
    "boxes_per_image": ("--boxes-per-image", "detection"),
    "busiest_image_boxes": ("--busiest-image-boxes", "detection"),
    "detection_counts": ("--detection-counts", "detection"),
    "targets_on_gpu": ("--targets-on-gpu", "detection"),
    "anchor_cache": ("the anchor cache", "detection"),
    "backbone_norm": ("--backbone-norm", "detection"),
    "focal_loss": ("--focal-loss", "detection"),
    "frames": ("--frames", "video"),
    "resolution": ("--resolution", "diffusion"),
    "diffusion_encoders": ("--diffusion-encoders", "diffusion"),
}
KIND_NAMES = {"detection": "detection", "video": "video", "diffusion": "diffusers"}


def check_task_options(built: BuiltModel, recipe: Recipe) -> None:
    """Refuse a task's option given for a model of another kind (``--frames`` on an image
    classifier would otherwise be read by nothing and the estimate would not say so).

    >>> check_task_options(resolve("torchvision:resnet18", Recipe()), Recipe(frames=4))
    Traceback (most recent call last):
    vramplan.errors.UserError: --frames applies to video models, not to torchvision:resnet18 (image)
    """
    from vramplan.recipe import VISION_DEFAULTS

    asked = [
        (flag, kind)
        for name, (flag, kind) in TASK_OPTIONS.items()
        if getattr(recipe, name) != VISION_DEFAULTS[name] and built.kind != kind
    ]
    if asked:
        flag, kind = asked[0]
        raise UserError(
            f"{flag} applies to {KIND_NAMES[kind]} models, not to {built.name} ({built.kind})"
        )


def with_source(spec: str) -> str:
    """``spec`` with ``hf:`` in front when it is a bare hub id (``ORG/NAME``, no colon, not
    a path that exists); anything else unchanged.

    >>> with_source("Qwen/Qwen2.5-7B"), with_source("timm:resnet50")
    ('hf:Qwen/Qwen2.5-7B', 'timm:resnet50')
    """
    from pathlib import Path

    from vramplan.sources.hub import parse_hub_id

    if ":" in spec or parse_hub_id(spec) is None or Path(spec).exists():
        return spec
    return f"hf:{spec}"


def _build_named(
    prefix: str, rest: str, recipe: Recipe, device: str, trust_remote_code: bool
) -> BuiltModel:
    if prefix == "torchvision":
        from vramplan.sources.vision import build_torchvision

        return build_torchvision(rest, recipe, device)
    if prefix == "timm":
        from vramplan.sources.vision import build_timm

        return build_timm(rest, recipe, device)
    if prefix == "diffusers":
        from vramplan.sources.diffusion import build_diffusers

        return build_diffusers(rest, recipe, device)
    from vramplan.sources.hf import build_hf

    return build_hf(rest, recipe, device, trust_remote_code)


__all__ = ["BuiltModel", "resolve", "with_source", "model_names", "model_tasks", "PREFIXES"]


def __getattr__(name: str):
    """``BuiltModel`` on first use: ``model_names("hf")`` imports no torch."""
    if name == "BuiltModel":
        from vramplan.sources.base import BuiltModel

        return BuiltModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def model_names(source: str) -> list[str]:
    """Names ``source:NAME`` accepts (``hf``: the bundled configs' hub ids).

    >>> "openai-community/gpt2" in model_names("hf")
    True
    """
    if source == "hf":
        from vramplan.sources.configs import bundled_configs

        return bundled_configs()
    if source == "torchvision":
        from vramplan.sources.vision import require_package, torchvision_tasks

        require_package("torchvision", "vision")
        return list(torchvision_tasks())
    if source == "timm":
        from vramplan.sources.vision import require_package

        return sorted(require_package("timm", "timm").list_models())
    if source == "diffusers":
        from vramplan.sources.diffusion import bundled_diffusers

        return bundled_diffusers()
    raise UserError(f"unknown source {source!r}; choose one of: hf, torchvision, timm, diffusers")


def model_tasks(source: str) -> dict[str, str]:
    """What vramplan trains for each name of ``source`` (torchvision: per model; others:
    one task for all)."""
    if source == "torchvision":
        from vramplan.sources.vision import require_package, torchvision_tasks

        require_package("torchvision", "vision")
        return torchvision_tasks()
    task = {
        "hf": "train, infer",
        "timm": "classification: train, infer",
        "diffusers": "noise-prediction training on precomputed latents, infer",
    }.get(source, "")
    return dict.fromkeys(model_names(source), task)
