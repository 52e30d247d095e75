"""Walk a config's fields, remembering which ones a reader used, so that none is dropped
silently: every leaf is either honoured (turned into a flag), noted with a reason, or
listed as ignored.

    >>> fields = Fields({"bf16": {"enabled": True}, "steps_per_print": 10})
    >>> fields.get("bf16.enabled")
    True
    >>> fields.honour("bf16.enabled", "precision", "amp-bf16")
    >>> fields.honoured
    ['bf16.enabled → --precision amp-bf16']
    >>> fields.ignored()
    ['steps_per_print']
"""

from __future__ import annotations

from typing import Any

from vramplan.errors import UserError

MISSING = object()


def flag_text(option: str, value: Any) -> str:
    """How the command line spells ``option=value``.

    >>> flag_text("offload_optimizer", True), flag_text("batch_size", 4)
    ('--offload-optimizer', '--batch-size 4')
    """
    flag = "--" + option.replace("_", "-")
    if value is True:
        return flag
    if value is False:
        return "--no-" + flag[2:]
    return f"{flag} {value}"


def _leaves(data: Any, prefix: str = "") -> list[str]:
    if isinstance(data, dict) and data:
        return [leaf for key, value in data.items() for leaf in _leaves(value, f"{prefix}{key}.")]
    return [prefix.rstrip(".")]


class Fields:
    """A config's nested mapping, its fields read by dotted path (``zero_optimization.stage``)."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.options: dict[str, Any] = {}
        """What the config asks for, by command-line option name (``batch_size``, ``zero``)."""
        self.honoured: list[str] = []
        self.notes: list[str] = []
        self._seen: set[str] = set()

    def peek(self, path: str, default: Any = None) -> Any:
        """The value at ``path`` (``default`` when absent), not counted as read."""
        node: Any = self.data
        for key in path.split("."):
            if not isinstance(node, dict) or key not in node:
                return default
            node = node[key]
        return node

    def has(self, path: str) -> bool:
        return self.peek(path, MISSING) is not MISSING

    def get(self, path: str, default: Any = None) -> Any:
        """The value at ``path`` (``default`` when absent); the field counts as read."""
        value = self.peek(path, MISSING)
        if value is MISSING:
            return default
        self._seen.add(path)
        return value

    def number(self, path: str, minimum: int = 1) -> int | None:
        """An integer field (``None`` when absent or ``"auto"``); a UserError otherwise."""
        value = self.get(path)
        if value is None or value == "auto":
            if value == "auto":
                self.note(path, "'auto' is filled in at launch; give the value as a flag")
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise UserError(f"{path} must be an integer of at least {minimum}, got {value!r}")
        return value

    def honour(self, path: str, option: str, value: Any, why: str = "") -> None:
        """Use ``path`` as the flag ``option=value`` and list it."""
        self.get(path)
        self.options[option] = value
        self.honoured.append(f"{path} → {flag_text(option, value)}" + (f" ({why})" if why else ""))

    def note(self, path: str, reason: str) -> None:
        """Name a field that is read but not modelled, with the reason."""
        self.get(path)
        self.notes.append(f"{path}: {reason}")

    def ignored(self) -> list[str]:
        """The leaves no reader looked at, a whole section as ``section.*``."""
        left = [
            leaf
            for leaf in _leaves(self.data)
            if not any(leaf == seen or leaf.startswith(seen + ".") for seen in self._seen)
        ]
        grouped: list[str] = []
        for leaf in left:
            top = leaf.split(".")[0]
            whole = all(x.split(".")[0] != top or x in left for x in _leaves(self.data))
            name = f"{top}.*" if whole and "." in leaf else leaf
            if name not in grouped:
                grouped.append(name)
        return grouped
