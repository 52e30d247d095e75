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

PREFIXES = ("torchvision", "timm", "hf")


def resolve(
    spec: str, recipe: Recipe, device: str = "meta", trust_remote_code: bool = False
) -> BuiltModel:
    """``torchvision:NAME``, ``timm:NAME``, ``hf:NAME`` (or ``hf:path/config.json``), a bare
    hub id ``ORG/NAME``, ``path/to/file.py:factory`` or ``package.module:factory``; built on
    the meta device (for tracing) or, for a real run, initialised on ``device``. A Hugging
    Face repository's own modeling code runs only with ``trust_remote_code``."""
    spec = with_source(spec)
    prefix, sep, rest = spec.partition(":")
    if not sep or not rest:
        raise UserError(
            f"cannot read model {spec!r}: use torchvision:NAME, timm:NAME, hf:NAME, "
            "a hub id ORG/NAME, path/to/file.py:factory or package.module:factory"
        )
    if prefix in PREFIXES:
        from vramplan.sources.finetune import apply_finetune

        built = _build_named(prefix, rest, recipe, device, trust_remote_code)
        return apply_finetune(built, recipe, device)
    from vramplan.sources.user_code import build_from_factory

    return build_from_factory(spec, recipe, device)


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
    from vramplan.sources.hf import build_hf

    return build_hf(rest, recipe, device, trust_remote_code)


__all__ = ["BuiltModel", "resolve", "with_source", "model_names", "PREFIXES"]


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
        from vramplan.sources.vision import require_package

        torchvision = require_package("torchvision", "vision")
        return sorted(
            torchvision.models.list_models(module=torchvision.models)
            + torchvision.models.list_models(module=torchvision.models.segmentation)
        )
    if source == "timm":
        from vramplan.sources.vision import require_package

        return sorted(require_package("timm", "timm").list_models())
    raise UserError(f"unknown source {source!r}; choose one of: hf, torchvision, timm")
