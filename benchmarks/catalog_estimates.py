"""Estimate the smallest bundled model of every family, as a user names it, to find the
bundled configs a default ``vramplan estimate`` refuses (two families did, unnoticed, until
2026-11-27: DINOv2 and sentence-transformers' bare BertModel)::

    python -m benchmarks.catalog_estimates            # every family, two at a time
    python -m benchmarks.catalog_estimates --jobs 1 qwen3 t5

Prints one row per family: the model, the exit code (0 fits, 3 does not fit the card, 2
refused), the peak or the refusal's line, and the seconds the command took.

    >>> [entry.hub_id for entry in smallest_per_family(["pythia"])]
    ['EleutherAI/pythia-70m']
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from vramplan.sources.catalog import catalog_entries, search

FITS, REFUSED, TOO_BIG = 0, 2, 3


def smallest_per_family(words: list[str] | None = None) -> list:
    """The entry with the fewest published parameters in each family (of the entries whose
    id or family holds one of ``words``, when given), by family name."""
    chosen = {e.hub_id for word in words or [] for e in search(word)}
    best: dict[str, object] = {}
    for entry in catalog_entries():
        if words and entry.hub_id not in chosen:
            continue
        held = best.get(entry.family)
        if held is None or entry.params < held.params:
            best[entry.family] = entry
    return [best[family] for family in sorted(best)]


def estimate_row(hub_id: str, gpu: str) -> tuple[str, int, str, float]:
    """``vramplan estimate hf:ID -b 1 --gpu GPU`` in a fresh process: its exit code and the
    line that matters (the peak, or the refusal)."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "vramplan", "estimate", f"hf:{hub_id}", "-b", "1", "--gpu", gpu],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = (done.stdout + done.stderr).splitlines()
    wanted = "error" if done.returncode == REFUSED else "Peak allocated"
    line = next((text.strip() for text in lines if wanted in text), "")
    return hub_id, done.returncode, line, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("words", nargs="*", help="only entries whose id or family holds one")
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--jobs", type=int, default=2)
    options = parser.parse_args(argv)
    entries = smallest_per_family(options.words)
    with ThreadPoolExecutor(max(1, options.jobs)) as pool:
        rows = list(pool.map(lambda e: estimate_row(e.hub_id, options.gpu), entries))
    print("| model | exit | peak or refusal | s |\n| --- | ---: | --- | ---: |")
    for hub_id, code, line, seconds in rows:
        print(f"| `{hub_id}` | {code} | {line} | {seconds:.1f} |")
    refused = [row for row in rows if row[1] not in (FITS, TOO_BIG)]
    print(f"\n{len(rows)} families, {len(refused)} refused or failed")
    return 1 if refused else 0


if __name__ == "__main__":
    raise SystemExit(main())
