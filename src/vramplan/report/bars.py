"""A compact bar of the components for the terminal.

>>> print(component_bar({"parameters": 1, "activations": 3}, width=8).plain)
██░░░░░░
"""

from __future__ import annotations

from rich.text import Text

from vramplan.report.palette import COLOURS
from vramplan.result import COMPONENTS


def component_bar(components: dict[str, int], width: int = 60) -> Text:
    """One line of blocks, each component's share of the width in its colour."""
    total = sum(components.values()) or 1
    bar = Text()
    used = 0
    names = [n for n in COMPONENTS if components.get(n, 0) > 0]
    for i, name in enumerate(names):
        cells = width - used if i == len(names) - 1 else round(components[name] / total * width)
        glyph = "█" if i % 2 == 0 else "░"
        bar.append(glyph * cells, style=COLOURS[name])
        used += cells
    return bar
