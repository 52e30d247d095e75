"""The per-layer table that ``vramplan layers`` prints before its estimate.

render_layers(vramplan.layers("examples/vgg16.yaml"), "binary")
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from vramplan.result import Estimate
from vramplan.units import format_bytes


def render_layers(estimate: Estimate, units: str) -> None:
    """The per-layer table of ``vramplan layers`` and its totals."""
    table = Table(title="Layers (per sample)", title_justify="left")
    for column in ("#", "type", "output", "parameters", "activations", "saved"):
        table.add_column(column, justify="left" if column in ("type", "output") else "right")
    for row in estimate.details["layers"]:
        table.add_row(
            str(row["index"]),
            row["type"],
            "x".join(map(str, row["output_shape"])),
            f"{row['parameters']:,}",
            f"{row['activation_values']:,}",
            format_bytes(row["saved_bytes_per_sample"], units),
        )
    Console().print(table)
    values = estimate.details["activation_values_per_sample"]
    Console().print(
        f"Total: {estimate.model.parameters:,} parameters, {values:,} activation "
        "values per sample (input included)"
    )
