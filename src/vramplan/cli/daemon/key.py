"""Which daemon may answer this process: a key of everything a warm process fixed when it
imported its libraries, and where daemons listen.

A daemon imported torch, transformers and vramplan once, with the environment variables of
its start; a command may use it only where the same Python would import the same code the
same way. The key hashes the interpreter, the installed versions of the libraries a step
imports, vramplan's own files (an edited checkout is a new key) and the variables those
libraries read at import time::

    >>> environment_key({"HF_HUB_OFFLINE": "1"}) == environment_key({"HF_HUB_OFFLINE": "1"})
    True
    >>> environment_key({"HF_HUB_OFFLINE": "1"}) == environment_key({})
    False
    >>> environment_key({"HF_HUB_OFFLINE": "1", "TERM": "xterm"}) == environment_key(
    ...     {"HF_HUB_OFFLINE": "1"})
    True
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import sys
from collections.abc import Mapping
from pathlib import Path

DIR_ENV = "VRAMPLAN_DAEMON_DIR"
"""Where daemons listen (default ``$XDG_RUNTIME_DIR/vramplan`` or ``~/.cache/vramplan/daemon``)."""
SWITCH_ENV = "VRAMPLAN_DAEMON"
"""``off``: run every command in its own process even where a daemon listens."""
ROUTED = frozenset({"estimate", "check", "max-batch", "plan", "serve"})
"""The commands a daemon answers: those that import torch (``measure`` and ``calibrate``
run on a GPU, in their own process; the others never import torch)."""
LIBRARIES = (
    "torch",
    "torchvision",
    "transformers",
    "timm",
    "peft",
    "diffusers",
    "bitsandbytes",
    "accelerate",
    "liger-kernel",
    "huggingface-hub",
    "typer",
    "rich",
)
IMPORT_TIME_PREFIXES = (
    "HF_",
    "HUGGINGFACE_",
    "TRANSFORMERS_",
    "DIFFUSERS_",
    "TORCH",
    "PYTORCH_",
    "CUDA_",
    "NVIDIA_",
    "OMP_",
    "MKL_",
    "KERAS_",
    "PYTHON",
    "VRAMPLAN_",
)
"""Variables read when the libraries load (``HF_HUB_OFFLINE`` is fixed at
``huggingface_hub``'s import, ``PYTORCH_CUDA_ALLOC_CONF`` at torch's ...): a daemon started
under other values would answer as that other environment."""
NOT_IMPORT_TIME = frozenset({DIR_ENV, SWITCH_ENV, "VRAMPLAN_DEBUG"})


def daemon_dir(environ: Mapping[str, str]) -> Path:
    """The folder daemons of this user listen in."""
    if environ.get(DIR_ENV):
        return Path(environ[DIR_ENV]).expanduser()
    if environ.get("XDG_RUNTIME_DIR"):
        return Path(environ["XDG_RUNTIME_DIR"]) / "vramplan"
    return Path.home() / ".cache" / "vramplan" / "daemon"


def _source_stamp() -> str:
    """vramplan's files (bundled data included) by name, size and modification time."""
    package = Path(__file__).resolve().parents[2]
    stamps = []
    for path in package.rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts:
            stat = path.stat()
            stamps.append(f"{path.relative_to(package)}:{stat.st_size}:{stat.st_mtime_ns}")
    return "\n".join([str(package), *sorted(stamps)])


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def environment_key(environ: Mapping[str, str]) -> str:
    """A short name for the environment this process would import its libraries in."""
    variables = sorted(
        f"{name}={value}"
        for name, value in environ.items()
        if name.startswith(IMPORT_TIME_PREFIXES) and name not in NOT_IMPORT_TIME
    )
    parts = [
        sys.executable,
        sys.prefix,
        sys.version,
        *(f"{name}={_version(name)}" for name in LIBRARIES),
        *variables,
        _source_stamp(),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def socket_path(environ: Mapping[str, str]) -> Path:
    """Where the daemon of this environment listens."""
    return daemon_dir(environ) / f"{environment_key(environ)}.sock"
