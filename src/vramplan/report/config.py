"""What a training config contributed, printed above a command's answer.

render_config_lines(("config ds.json (DeepSpeed): zero_optimization.stage → --zero 3",))
"""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape


def render_config_lines(lines: tuple[str, ...]) -> None:
    """One dim line per entry (nothing without a config)."""
    console = Console()
    for line in lines:
        console.print(f"[dim]{escape(line)}[/dim]", highlight=False)
