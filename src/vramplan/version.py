"""vramplan's own version, and those of the libraries an estimate depended on.

>>> "torch" in library_versions()
True
"""

from __future__ import annotations

import importlib.metadata
import platform

__version__ = "0.1.0"


def library_versions() -> dict[str, str]:
    """Installed versions of Python, torch and the optional model libraries."""
    found = {"python": platform.python_version()}
    for name in ("torch", "torchvision", "transformers", "timm"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found
