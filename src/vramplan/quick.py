"""Answers without tracing — ``calc``, ``layers``, ``llm``, ``gpus`` and ``models`` — in a
module that imports neither torch nor a model library, so the commands built on it start
in a fraction of a second::

    >>> calc("20M", optimizer="sgd").components["gradients"]
    80000000
    >>> gpus()[0].name != ""
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vramplan.analytic.calc import METHODS, calculate
from vramplan.analytic.layers import layers_estimate, load_spec
from vramplan.analytic.transformer import LoRA, Parallelism, transformer_estimate
from vramplan.device.catalog import GpuSpec, catalog
from vramplan.errors import UserError
from vramplan.recipe import Recipe, parse_shape
from vramplan.result import Estimate
from vramplan.sources import PREFIXES, model_names, with_source
from vramplan.sources.catalog import search as search_catalog
from vramplan.sources.configs import load_config_dict, validate_config
from vramplan.units import parse_count


def calc(
    params: str | int,
    *,
    activations_per_sample: str | int = 0,
    batch_size: int = 1,
    input_shape: str | tuple[int, ...] | None = None,
    precision: str = "fp32",
    optimizer: str = "adamw",
    mode: str = "train",
    method: str = "pytorch",
) -> Estimate:
    """The classic arithmetic (``vramplan calc``): ``params`` and activations per sample
    as numbers or with suffixes (``"20M"``, ``"1.3B"``)."""
    recipe = Recipe(batch_size=batch_size, precision=precision, optimizer=optimizer, mode=mode)
    return calculate(
        parse_count(params, "parameter count", minimum=1),
        batch_size,
        parse_count(activations_per_sample, "activations per sample"),
        recipe,
        _method(method),
        parse_shape(input_shape) if isinstance(input_shape, str) else input_shape,
    )


def layers(
    spec: str | Path,
    *,
    batch_size: int = 1,
    precision: str = "fp32",
    optimizer: str = "adamw",
    mode: str = "train",
    method: str = "pytorch",
) -> Estimate:
    """A table of layers from a YAML/JSON spec, shapes propagated (``vramplan layers``)."""
    recipe = Recipe(batch_size=batch_size, precision=precision, optimizer=optimizer, mode=mode)
    return layers_estimate(load_spec(str(spec)), recipe, _method(method), name=str(spec))


def llm(
    model: str,
    *,
    batch_size: int = 1,
    seq_len: int | None = None,
    precision: str | None = None,
    optimizer: str = "adamw",
    mode: str = "train",
    attention: str = "flash",
    recompute: str = "none",
    tp: int = 1,
    sp: bool = False,
    lora_rank: int = 0,
    qlora: bool = False,
) -> Estimate:
    """Transformer formulas from an ``hf:`` config, no model built (``vramplan llm``).
    ``precision`` defaults to ``amp-bf16``, how such models train (``estimate``'s default
    is ``fp32``); the answer's notes say so when it was not given. The config passes the
    same validation ``estimate`` applies before building."""
    if attention not in ("flash", "eager"):
        raise UserError(f"unknown attention {attention!r}; choose flash or eager")
    if recompute not in ("none", "selective", "full"):
        raise UserError(f"unknown recompute {recompute!r}; choose none, selective or full")
    if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 0:
        raise UserError(
            f"LoRA rank must be a positive integer (or 0 for full fine-tuning), got {lora_rank}"
        )
    if qlora and lora_rank == 0:
        raise UserError("--qlora needs --lora-rank R (a positive rank)")
    prefix, _, name = with_source(model).partition(":")
    if prefix != "hf" or not name:
        raise UserError(
            f"llm takes hf:NAME, a hub id ORG/NAME or hf:path/config.json, got {model!r}"
        )
    label, config = load_config_dict(name)
    validate_config(label, config)
    default_precision = precision is None
    precision = "amp-bf16" if default_precision else precision
    recipe = Recipe(
        batch_size=batch_size, seq_len=seq_len, precision=precision, optimizer=optimizer, mode=mode
    )
    estimate = transformer_estimate(
        config,
        recipe,
        f"hf:{label}",
        flash=attention == "flash",
        parallel=Parallelism(tp, sp),
        recompute=recompute,
        lora=LoRA(lora_rank, 4 if qlora else 16) if lora_rank else None,
    )
    if default_precision:
        note = "precision amp-bf16: llm's default (estimate's is fp32); --precision sets it"
        estimate = estimate.with_changes(notes=(note, *estimate.notes))
    return estimate


def _method(method: str) -> str:
    if method not in METHODS:
        raise UserError(f"unknown method {method!r}; choose pytorch or cs231n")
    return method


def gpus() -> tuple[GpuSpec, ...]:
    """The GPU catalog."""
    return catalog()


def models(source: str = "hf") -> list[str]:
    """The model names a source (``hf``, ``torchvision``, ``timm``) accepts."""
    return model_names(source)


@dataclass(frozen=True)
class ModelMatch:
    """A model a source accepts, as ``vramplan models --search`` shows it."""

    name: str
    """What to pass as the model: ``hf:ORG/NAME``, ``timm:NAME``, ``torchvision:NAME``."""
    family: str = ""
    licence: str = ""
    params: int | None = None
    """The published parameter count (bundled Hugging Face configs only)."""
    params_exact: bool = True
    """False where the published count is a rounded figure (``1.7B``)."""


def find_models(text: str = "", source: str | None = None) -> list[ModelMatch]:
    """The models of ``source`` (every source when None) whose names hold every word of
    ``text``; for ``hf`` the bundled catalog, searched by hub id, alias and family::

        >>> [m.name for m in find_models("llama 3.2 3b instruct", "hf")]
        ['hf:meta-llama/Llama-3.2-3B-Instruct']
    """
    if source not in (None, *PREFIXES):
        raise UserError(f"unknown source {source!r}; choose one of: hf, torchvision, timm")
    found = [
        ModelMatch(f"hf:{e.hub_id}", e.family, e.licence, e.params, e.params_exact)
        for e in (search_catalog(text) if source in (None, "hf") else ())
    ]
    words = text.lower().split()
    for library in ("torchvision", "timm"):
        if source not in (None, library):
            continue
        try:
            names = model_names(library)
        except UserError:  # the library is not installed: say so only when it was asked for
            if source == library:
                raise
            continue
        found += [ModelMatch(f"{library}:{n}") for n in names if all(w in n.lower() for w in words)]
    return found
