"""Training configs users already have, read into the flags they amount to: a DeepSpeed
JSON, an accelerate config, a torchtune recipe, an axolotl YAML or a torchtitan TOML.

The tool is told by the file's extension and content::

    config = read_config("ds_config.json")
    config.recipe(), config.layout()          # what vramplan estimates
    config.with_flags(batch_size=8)           # a flag given beside the file wins
    config.lines()                            # what was honoured, noted and ignored
"""

from __future__ import annotations

from pathlib import Path

from vramplan.configs.accelerate import read_accelerate
from vramplan.configs.axolotl import read_axolotl
from vramplan.configs.config import TrainingConfig
from vramplan.configs.deepspeed import read_deepspeed
from vramplan.configs.fields import Fields
from vramplan.configs.files import load_mapping
from vramplan.configs.torchtitan import read_torchtitan
from vramplan.configs.torchtune import read_torchtune
from vramplan.errors import UserError

DEEPSPEED_KEYS = (
    "zero_optimization",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "fp16",
    "bf16",
)
TORCHTITAN_SECTIONS = ("model", "training", "parallelism", "activation_checkpoint", "job")


def config_tool(path: str | Path, data: dict) -> str:
    """Which tool wrote ``data`` (read from ``path``): by extension, then by its keys.

    >>> config_tool("run.yaml", {"distributed_type": "FSDP"})
    'accelerate'
    """
    suffix = Path(path).suffix.lower()
    if suffix == ".toml":
        if any(isinstance(data.get(s), dict) for s in TORCHTITAN_SECTIONS):
            return "torchtitan"
        raise UserError(f"{path} is not a torchtitan config: it has no [model] or [training]")
    if suffix == ".json":
        if any(key in data for key in DEEPSPEED_KEYS):
            return "DeepSpeed"
        raise UserError(
            f"{path} is not a DeepSpeed config: it has none of {', '.join(DEEPSPEED_KEYS)}"
        )
    if "distributed_type" in data or "compute_environment" in data:
        return "accelerate"
    if isinstance(data.get("model"), dict) and "_component_" in data["model"]:
        return "torchtune"
    if "base_model" in data:
        return "axolotl"
    raise UserError(
        f"cannot tell which tool {path} is for: expected accelerate's distributed_type, "
        "torchtune's model._component_ or axolotl's base_model"
    )


def read_config(path: str | Path) -> TrainingConfig:
    """The training config at ``path`` (a UserError when malformed or contradictory)."""
    data = load_mapping(path)
    tool = config_tool(path, data)
    fields = Fields(data)
    model, total = None, None
    if tool == "DeepSpeed":
        total = read_deepspeed(fields)
    elif tool == "accelerate":
        read_accelerate(fields)
    elif tool == "torchtune":
        model = read_torchtune(fields)
    elif tool == "axolotl":
        model = read_axolotl(fields)
    else:
        model = read_torchtitan(fields)
    config = TrainingConfig(
        path=str(path),
        tool=tool,
        model=model,
        options=dict(fields.options),
        honoured=tuple(fields.honoured),
        notes=tuple(fields.notes),
        ignored=tuple(fields.ignored()),
        global_batch=total,
    )
    config.layout()  # a contradiction in the layout is refused now, in one line
    return config


__all__ = ["TrainingConfig", "read_config", "config_tool"]
