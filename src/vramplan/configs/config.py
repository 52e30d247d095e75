"""A training config as vramplan reads it: the model it names, the flags it amounts to,
and what was honoured, noted or ignored. Flags given beside it override it::

    >>> config = TrainingConfig("ds.json", "DeepSpeed", None,
    ...     {"batch_size": 4, "grad_accum": 2, "zero": 3, "dp": 8}, global_batch=64)
    >>> config.recipe().batch_size, config.layout().describe()
    (4, 'zero3 dp=8')
    >>> config.with_flags(batch_size=2).recipe().batch_size
    2
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from vramplan.distributed.layout import ParallelLayout
from vramplan.distributed.options import layout_from_flags
from vramplan.errors import UserError
from vramplan.recipe import Recipe

RECIPE_OPTIONS = (
    "batch_size",
    "seq_len",
    "input_shape",
    "precision",
    "optimizer",
    "checkpointing",
    "grad_accum",
    "mode",
    "lora",
    "lora_targets",
    "lora_alpha",
    "lora_dropout",
    "freeze",
    "train_only",
    "quantize",
    "double_quant",
    "compute_dtype",
    "compile",
    "optimizer_in_backward",
    "activation_offload",
    "loss_chunks",
    "dora",
    "reentrant",
    "repeat_kv",
)
LAYOUT_OPTIONS = tuple(inspect.signature(layout_from_flags).parameters)
"""The parallel-layout flags: the keyword arguments of ``layout_from_flags``."""
OPTIONS = ("model", *RECIPE_OPTIONS, *LAYOUT_OPTIONS)
SHARDINGS = ("fsdp", "world_size", "zero")
"""The data-parallel schemes, one at a time: a flag naming one replaces the config's."""
SHARDING_DETAILS = ("shard", "reshard_after_forward", "dp", "offload_optimizer", "offload_params")
BATCH_FACTORS = ("batch_size", "grad_accum")
"""Flags that ask "what if" about the batch: the file's total batch no longer binds them (a
flag changing the GPU count is still checked against it, as DeepSpeed would at launch)."""


@dataclass(frozen=True)
class TrainingConfig:
    """What a DeepSpeed, accelerate, torchtune, axolotl or torchtitan file asks for.

    ``options`` are keyed by the command line's option names (``batch_size``, ``zero``,
    ``lora``...); ``global_batch`` is a total batch the file states (DeepSpeed's
    ``train_batch_size``), checked against batch × accumulation × data-parallel GPUs.
    """

    path: str
    tool: str
    model: str | None
    options: dict[str, Any] = field(default_factory=dict)
    honoured: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()
    global_batch: int | None = None
    overridden: tuple[str, ...] = ()
    FLAGS: ClassVar[tuple[str, ...]] = OPTIONS
    """The option names a config can set (and a flag override)."""

    def with_flags(self, **flags: Any) -> TrainingConfig:
        """The config with command-line flags put over it (the flags win)."""
        unknown = sorted(set(flags) - set(OPTIONS))
        if unknown:
            raise UserError(f"a config has no option {unknown[0]!r}")
        options = dict(self.options)
        if any(name in flags for name in SHARDINGS):
            for name in (*SHARDINGS, *SHARDING_DETAILS):
                options.pop(name, None)
        if "zero" in flags:  # the FSDP version stays with --fsdp N or --world-size N
            options.pop("fsdp_version", None)
        model = flags.pop("model", None) or self.model
        changed = tuple(
            f"--{name.replace('_', '-')}"
            for name in flags
            if name in options and options[name] != flags[name]
        )
        options.update(flags)
        still_checked = not any(name in flags for name in BATCH_FACTORS)
        return replace(
            self,
            model=model,
            options=options,
            global_batch=self.global_batch if still_checked else None,
            overridden=self.overridden + changed,
        )

    def recipe(self) -> Recipe:
        """The Recipe the config (and any flags put over it) asks for."""
        knobs = {name: self.options[name] for name in RECIPE_OPTIONS if name in self.options}
        if "lora" in knobs:
            knobs["lora_rank"] = knobs.pop("lora")
        recipe = Recipe(**knobs)
        self._check_global_batch(recipe)
        return recipe

    def layout(self) -> ParallelLayout:
        """The parallel layout (one GPU when the config names none)."""
        flags = {name: self.options[name] for name in LAYOUT_OPTIONS if name in self.options}
        return layout_from_flags(**flags)

    def _check_global_batch(self, recipe: Recipe) -> None:
        if self.global_batch is None:
            return
        gpus = self.layout().data_parallel
        product = recipe.batch_size * recipe.grad_accum * gpus
        if product != self.global_batch:
            raise UserError(
                f"{self.path}: train_batch_size {self.global_batch} is not micro-batch "
                f"{recipe.batch_size} × accumulation {recipe.grad_accum} × {gpus} GPUs "
                f"(= {product})"
            )

    def lines(self) -> tuple[str, ...]:
        """What the config contributed, for an estimate's notes: the fields honoured, those
        read but not modelled, those ignored, and the flags that overrode it."""
        name = f"config {self.path} ({self.tool})"
        lines = [f"{name}: " + ("; ".join(self.honoured) or "no field changes the step")]
        lines += [f"{name}, not modelled: {note}" for note in self.notes]
        if self.ignored:
            lines.append(
                f"{name}, ignored (no effect on memory modelled): {', '.join(self.ignored)}"
            )
        if self.overridden:
            lines.append(f"{name}: overridden by {', '.join(self.overridden)}")
        return tuple(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "tool": self.tool,
            "model": self.model,
            "options": dict(self.options),
            "honoured": list(self.honoured),
            "not_modelled": list(self.notes),
            "ignored": list(self.ignored),
            "overridden_by": list(self.overridden),
        }
