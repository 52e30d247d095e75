"""Hugging Face hub ids (``ORG/NAME``, ``ORG/NAME@REVISION``): a ``config.json`` from the
user's Hub cache, else, when online and ``HF_HUB_OFFLINE`` is not set, from the Hub —
config files only, never weights. Neither torch nor transformers is imported; the cache is
read as the Hub lays it out (``models--ORG--NAME/refs/main`` names the snapshot that holds
``config.json``)::

    >>> parse_hub_id("Qwen/Qwen2.5-7B@main")
    HubId(repo='Qwen/Qwen2.5-7B', revision='main')
    >>> parse_hub_id("gpt2") is None
    True
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from vramplan.errors import UserError

_HUB_ID = re.compile(r"^([A-Za-z0-9][\w.-]*)/([\w.-]+)(?:@([\w./-]+))?$")
_TRUE = {"1", "on", "yes", "true"}
_AUTH_HINT = "log in with `huggingface-cli login` (or `hf auth login`) or set HF_TOKEN"


@dataclass(frozen=True)
class HubId:
    """A repository on the Hub and the revision asked for (``None``: main)."""

    repo: str
    revision: str | None = None

    @property
    def label(self) -> str:
        return self.repo if self.revision is None else f"{self.repo}@{self.revision}"


def parse_hub_id(text: str) -> HubId | None:
    """``ORG/NAME`` or ``ORG/NAME@REV`` as a HubId; None for anything else."""
    match = _HUB_ID.match(text.strip())
    if not match or ".." in text:
        return None
    return HubId(f"{match[1]}/{match[2]}", match[3])


def cache_root() -> Path:
    """Where the Hub's cache lives: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
    ``~/.cache/huggingface/hub`` (``XDG_CACHE_HOME`` moves it), as huggingface_hub does."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "huggingface" / "hub"


def _repo_folder(root: Path, repo: str) -> Path | None:
    folder = root / f"models--{repo.replace('/', '--')}"
    if folder.is_dir():
        return folder
    if not root.is_dir():
        return None
    wanted = folder.name.lower()  # the Hub's ids are case-insensitive
    try:
        return next((p for p in root.iterdir() if p.name.lower() == wanted and p.is_dir()), None)
    except OSError:
        return None


def cached_config(hub_id: HubId, filename: str = "config.json") -> Path | None:
    """The cached ``filename`` of ``hub_id``'s revision (a branch or tag under ``refs/``, or
    a commit hash), or None when the cache does not hold it."""
    folder = _repo_folder(cache_root(), hub_id.repo)
    if folder is None:
        return None
    revision = hub_id.revision or "main"
    ref = folder / "refs" / revision
    try:
        commit = ref.read_text().strip() if ref.is_file() else revision
    except OSError:
        return None
    path = folder / "snapshots" / commit / filename
    if path.is_file():
        return path
    if hub_id.revision is None:  # no refs/main: a cache holding one snapshot
        snapshots = sorted((folder / "snapshots").glob(f"*/{filename}"))
        if len(snapshots) == 1:
            return snapshots[0]
    return None


def hub_offline() -> bool:
    """Whether the user said not to reach the Hub (``HF_HUB_OFFLINE``, ``TRANSFORMERS_OFFLINE``)."""
    return any(
        os.environ.get(v, "").strip().lower() in _TRUE
        for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _reachable() -> bool:
    """A quick look at the endpoint before huggingface_hub's retries (half a minute on a
    machine without a network); behind a proxy the proxy decides, so it is assumed."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname or "", port), timeout=3).close()
    except OSError:
        return False
    return True


def download_config(hub_id: HubId, filename: str = "config.json") -> Path | None:
    """``filename`` (a config file, never weights) fetched from the Hub into the user's
    cache; None when offline or the Hub cannot be reached. A gated or private repository,
    a missing one, a missing revision or a repository without ``filename`` is a UserError."""
    if hub_offline():
        return None
    try:
        import huggingface_hub
        from huggingface_hub import utils as errors
    except ImportError:
        return None
    if not _reachable():
        return None
    try:
        return Path(
            huggingface_hub.hf_hub_download(
                hub_id.repo, filename, revision=hub_id.revision, cache_dir=cache_root()
            )
        )
    except errors.LocalEntryNotFoundError:  # no connection and nothing cached
        return None
    except errors.GatedRepoError:
        raise UserError(
            f"{hub_id.repo} is gated on the Hugging Face Hub: accept its licence on "
            f"huggingface.co/{hub_id.repo}, then {_AUTH_HINT}"
        ) from None
    except errors.RevisionNotFoundError:
        raise UserError(f"{hub_id.repo} has no revision {hub_id.revision!r} on the Hub") from None
    except errors.RepositoryNotFoundError:
        raise UserError(
            f"{hub_id.repo} is not on the Hugging Face Hub, or it is private ({_AUTH_HINT})"
        ) from None
    except errors.EntryNotFoundError:
        raise UserError(
            f"{hub_id.label} has no {filename} on the Hub (not a transformers model?)"
        ) from None
    except errors.HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status in (401, 403):
            raise UserError(
                f"the Hub refused {hub_id.repo} (HTTP {status}): {_AUTH_HINT}"
            ) from None
        return None
    except (OSError, ValueError):  # no connection, a timeout, a local cache error
        return None
