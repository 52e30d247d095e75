"""What the allocator probes share (``sdpa_workspace``, ``reduce_workspace``,
``rnn_workspace``): every request the caching allocator sees during a call, read off
``torch.cuda.memory._record_memory_history``, and the run that writes one JSON of records
beside the card's versions::

    >>> requests_in([{"action": "alloc", "addr": 1, "size": 512},
    ...              {"action": "alloc", "addr": 2, "size": 1024},
    ...              {"action": "free_requested", "addr": 2, "size": 1024}])
    [{'size': 512, 'kept': True}, {'size': 1024, 'kept': False}]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from pathlib import Path


def events_since(torch, since: int) -> list[dict]:
    """The allocator's history from event ``since`` on."""
    return torch.cuda.memory._snapshot()["device_traces"][0][since:]


def requests_in(events: list[dict]) -> list[dict]:
    """The allocations among ``events`` in order: size, and whether still live at the end."""
    out, live = [], {}
    for event in events:
        if event["action"] == "alloc":
            live[event["addr"]] = len(out)
            out.append({"size": event["size"], "kept": True})
        elif event["action"] == "free_requested" and event["addr"] in live:
            out[live.pop(event["addr"])]["kept"] = False
    return out


def requests_of(torch, call: Callable[[], object]) -> tuple[list[dict], object]:
    """The requests ``call()`` makes (the device synchronized after it), and its result."""
    start = len(events_since(torch, 0))
    result = call()
    torch.cuda.synchronize()
    return requests_in(events_since(torch, start)), result


def each_case(cases, run_case) -> Callable[[object], Iterator[dict]]:
    """The records of ``run_case(torch, case)`` for every case; one that fails is recorded
    with its error (named by ``case.name``) and the others go on."""

    def records(torch) -> Iterator[dict]:
        for case in cases:
            try:
                yield run_case(torch, case)
            except (RuntimeError, TypeError, ValueError) as exc:
                yield {"case": case.name, "error": str(exc).splitlines()[0][:200]}

    return records


def run_probe(
    description: str,
    argv: list[str] | None,
    records: Callable[[object], Iterator[dict]],
    brief: Callable[[dict], str],
) -> int:
    """Parse ``--out``, record the allocator's history, write every record ``records(torch)``
    yields (printing ``brief(record)`` for each) with the card's versions."""
    parser = argparse.ArgumentParser(description=description.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    options = parser.parse_args(argv)
    import torch

    torch.cuda.init()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, context=None, stacks="python")
    written = []
    for record in records(torch):
        written.append(record)
        print(brief(record))
        torch.cuda.empty_cache()
    props = torch.cuda.get_device_properties(0)
    versions = {
        "gpu": props.name,
        "multiprocessors": props.multi_processor_count,
        "threads_per_multiprocessor": props.max_threads_per_multi_processor,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
    }
    options.out.write_text(json.dumps({"versions": versions, "records": written}, indent=1))
    return 0
