"""``--config FILE``: a training config (DeepSpeed, accelerate, torchtune, axolotl,
torchtitan) read into the command's options; a flag given beside it wins.

$ vramplan estimate hf:meta-llama-3-8b --config ds_config.json --gpu h100
$ vramplan estimate --config qlora.yaml --batch-size 8     # the model named in the file
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

import vramplan
from vramplan import UserError

ConfigOpt = Annotated[
    str | None,
    typer.Option(
        "--config",
        help="A training config to read: DeepSpeed JSON, accelerate YAML, torchtune recipe, "
        "axolotl YAML or torchtitan TOML (flags given beside it win).",
    ),
]
OptionalModel = Annotated[
    str | None,
    typer.Argument(
        help="torchvision:NAME, timm:NAME, hf:NAME (or hf:path/config.json), file.py:factory, "
        "package.module:factory; optional with a --config that names the model",
        show_default=False,
    ),
]
_GIVEN = ("COMMANDLINE", "ENVIRONMENT", "PROMPT")


def _given(ctx: typer.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in _GIVEN


def with_config(
    options: dict[str, Any], ctx: typer.Context
) -> tuple[dict[str, Any], vramplan.TrainingConfig | None]:
    """The command's options (e.g. its ``locals()``) with ``--config``'s values where no
    flag was given, and the config read (``None`` without ``--config``)."""
    path = options.get("config")
    if path is None:
        if options.get("model") is None:
            raise UserError(
                "give a MODEL (hf:NAME, torchvision:NAME, file.py:factory...) or --config FILE"
            )
        return options, None
    flags = {
        name: options[name]
        for name in vramplan.TrainingConfig.FLAGS
        if name in options and _given(ctx, name)
    }
    config = vramplan.read_config(path).with_flags(**flags)
    if config.model is None:
        raise UserError(
            f"{path} names no model vramplan knows: give MODEL before --config "
            "(hf:NAME or hf:path/config.json)"
        )
    merged = {**options, "model": config.model}
    merged.update({k: v for k, v in config.options.items() if k in options})
    config.recipe()  # a total batch that does not add up is refused here, in one line
    return merged, config


def config_lines(
    config: vramplan.TrainingConfig | None, options: dict[str, Any]
) -> tuple[str, ...]:
    """What the config contributed, and what this command could not apply."""
    if config is None:
        return ()
    unused = [
        f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
        for k, v in config.options.items()
        if k not in options
    ]
    lines = config.lines()
    if unused:
        lines += (
            f"config {config.path}: not applied by this command (one GPU): {', '.join(unused)}",
        )
    return lines
