"""Build every bundled Hugging Face config on the meta device and compare its parameter
count with the published one (``data/hf/index.json``), and with ``vramplan llm``'s
formulas where they cover the family.

    python benchmarks/catalog_check.py            # every entry
    python benchmarks/catalog_check.py qwen3 phi  # entries whose id or family holds a word

Prints one row per model: built (transformers, meta device), published, their difference,
the formulas' count, and the seconds the build took. Exact published counts must match to
the parameter; rounded ones (params_exact: false) within the rounding of the figure.
"""

from __future__ import annotations

import sys
import time

import torch
import transformers

from vramplan.errors import UserError
from vramplan.sources.catalog import catalog_entries, entry_config, search
from vramplan.sources.configs import validate_config

transformers.logging.set_verbosity_error()


def built_parameters(config: dict, model_class: str = "") -> tuple[int, str]:
    """The parameters transformers builds for ``config`` on the meta device: ``model_class``,
    else the config's architectures class, else the bare model."""
    fields = {k: v for k, v in config.items() if k not in ("model_type", "transformers_version")}
    made = transformers.AutoConfig.for_model(config["model_type"], **fields)
    names = [model_class] if model_class else config.get("architectures") or []
    cls = getattr(transformers, names[0], None) if names else None
    with torch.device("meta"):
        model = cls._from_config(made) if cls else transformers.AutoModel.from_config(made)
    return sum(p.numel() for p in model.parameters()), type(model).__name__


def rounding(published: int) -> float:
    """How far a rounded published figure may be from the count: half its last digit's
    unit (1.7B: 0.05B), or 1% where that is more."""
    digits = str(published)
    unit = 10 ** (len(digits) - len(digits.rstrip("0")))
    return max(unit / 2, published / 100)


def formula_parameters(config: dict) -> int | None:
    from vramplan.analytic.transformer import shape_from_config

    try:
        return shape_from_config(config).parameters()
    except UserError:
        return None


def main(words: list[str]) -> int:
    chosen = {e.hub_id for word in words for e in search(word)}
    entries = [e for e in catalog_entries() if not words or e.hub_id in chosen]
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    print(f"{'hub id':44} {'built':>16} {'published':>16} {'diff':>8} {'formulas':>16}  class")
    bad = 0
    for entry in entries:
        config = entry_config(entry)
        start = time.perf_counter()
        try:
            validate_config(entry.hub_id, config)
            built, cls = built_parameters(config, entry.params_model)
        except Exception as exc:  # report and go on: this is a survey
            print(f"{entry.hub_id:44} cannot build: {' '.join(str(exc).split())[:120]}")
            bad += 1
            continue
        seconds = time.perf_counter() - start
        published = entry.params
        diff = (built - published) / published
        off = abs(built - published)
        ok = off == 0 if entry.params_exact else off <= rounding(published)
        formula = formula_parameters(config)
        shown = "-" if formula is None else format(formula, ",")
        bad += not ok
        print(
            f"{entry.hub_id:44} {built:>16,} {published:>16,} {diff:>+8.2%} "
            f"{shown:>16}  {cls} "
            f"{seconds:.1f}s{'' if ok else '  <-- differs'}"
        )
        if not ok and entry.params_note:
            print(f"{'':44} published: {entry.params_note}")
    print(f"{len(entries)} models, {bad} differ or fail")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
