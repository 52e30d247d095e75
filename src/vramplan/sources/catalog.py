"""The bundled catalog of Hugging Face configs, stored under their hub ids
(``data/hf/ORG/NAME.json``) and listed in ``data/hf/index.json`` with each model's family,
licence, source and published parameter count. Data files only: nothing is imported from
torch or transformers, nothing is downloaded::

    >>> find_entry("meta-llama/Llama-3.2-3B").params
    3212749824
    >>> find_entry("gpt2").hub_id                # the short names people use
    'openai-community/gpt2'
    >>> [e.hub_id for e in search("mixtral 8x22")]
    ['mistralai/Mixtral-8x22B-v0.1']
"""

from __future__ import annotations

import difflib
import functools
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any


@dataclass(frozen=True)
class CatalogEntry:
    """One bundled config: where it came from, under which licence, how big it is."""

    hub_id: str
    family: str
    licence: str
    source: str
    params: int
    """The published parameter count."""
    params_exact: bool
    """Whether ``params`` is published to the parameter (else it is a rounded figure)."""
    params_note: str
    """Where the published count comes from, and what it counts."""
    params_model: str
    """The transformers class the published count counts, where it is not the config's
    ``architectures`` (an encoder's paper counts the bare model, without its head)."""
    aliases: tuple[str, ...]

    @property
    def name(self) -> str:
        """The repository's name without its organisation."""
        return self.hub_id.split("/", 1)[1]

    def spellings(self) -> tuple[str, ...]:
        """Every lower-case spelling that names this entry."""
        return (self.hub_id.lower(), self.name.lower(), *(a.lower() for a in self.aliases))


def _folder():
    return resources.files("vramplan") / "data" / "hf"


@functools.lru_cache(maxsize=1)
def catalog_entries() -> tuple[CatalogEntry, ...]:
    """Every bundled entry, in the index's order."""
    index = json.loads((_folder() / "index.json").read_text())
    return tuple(
        CatalogEntry(
            hub_id=row["id"],
            family=row["family"],
            licence=row["licence"],
            source=row["source"],
            params=row["params"],
            params_exact=row["params_exact"],
            params_note=row.get("params_note", ""),
            params_model=row.get("params_model", ""),
            aliases=tuple(row.get("aliases", ())),
        )
        for row in index["models"]
    )


@functools.lru_cache(maxsize=1)
def _by_key() -> dict[str, CatalogEntry]:
    found: dict[str, CatalogEntry] = {}
    names: dict[str, int] = {}
    for entry in catalog_entries():
        names[entry.name.lower()] = names.get(entry.name.lower(), 0) + 1
    for entry in catalog_entries():
        for key in entry.spellings():
            if key == entry.name.lower() and names[key] > 1:
                continue  # a bare name two organisations share names neither
            found.setdefault(key, entry)
    return found


def find_entry(name: str) -> CatalogEntry | None:
    """The entry a hub id (any case), a bare repository name or a short alias names;
    ``ORG/ALIAS`` too where ``ORG`` is the entry's organisation."""
    key = name.strip().lower()
    entry = _by_key().get(key)
    if entry is None and "/" in key:
        org, _, rest = key.partition("/")
        entry = _by_key().get(rest)
        if entry is not None and entry.hub_id.lower().split("/")[0] != org:
            entry = None
    return entry


def entry_config(entry: CatalogEntry) -> dict[str, Any]:
    """The bundled config.json of ``entry``."""
    org, name = entry.hub_id.split("/", 1)
    return json.loads((_folder() / org / f"{name}.json").read_text())


def search(text: str) -> list[CatalogEntry]:
    """Entries whose hub id, family or aliases hold every word of ``text`` (any case)."""
    words = text.lower().split()
    return [
        entry
        for entry in catalog_entries()
        if all(
            any(word in key for key in (*entry.spellings(), entry.family.lower())) for word in words
        )
    ]


def close_matches(name: str, count: int = 3) -> list[str]:
    """Hub ids of the entries whose names look like ``name``."""
    key = name.strip().lower()
    keys = _by_key()
    candidates = difflib.get_close_matches(key, list(keys), n=count * 3, cutoff=0.6)
    if "/" in key:
        candidates += difflib.get_close_matches(key.split("/", 1)[1], list(keys), n=count)
    ids = dict.fromkeys(keys[c].hub_id for c in candidates)
    return list(ids)[:count]
