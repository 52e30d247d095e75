"""What the device model costs on one long trace: the allocator replay alone, and all of
``apply_device`` (three replays, the step's other orders, the summary), prints only.

A plan's trials each end in ``apply_device`` over the full depth (a Llama-3-70B QLoRA step
at 4096 tokens: some 200,000 allocator requests per replay), so its cost is a share of
every plan. The trace is made once (the estimate's own, caught on its way to the device
model); each figure is the best of ``--repeats`` CPU times, with the peak it found::

    python -m benchmarks.speed.replay
    python -m benchmarks.speed.replay --model hf:meta-llama/Meta-Llama-3-8B --repeats 5
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import vramplan.pipeline as pipeline
from vramplan.collector import quiet
from vramplan.device.allocator import AllocatorConfig, Replay
from vramplan.device.replay import requests_of
from vramplan.session import Session

QLORA = {
    "precision": "bf16",
    "quantize": "nf4",
    "double_quant": True,
    "lora_rank": 16,
    "lora_targets": "all-linear",
    "loss_chunks": 8,
    "grad_accum": 4,
    "checkpointing": "full",
}


def caught_call(model: str, gpu: str, batch_size: int, seq_len: int) -> tuple[tuple, dict]:
    """The arguments the estimate hands ``apply_device`` (a QLoRA step of ``model``)."""
    caught: list[tuple[tuple, dict]] = []
    original = pipeline.apply_device

    def catch(*args, **kwargs):
        caught.append((args, kwargs))
        return original(*args, **kwargs)

    pipeline.apply_device = catch
    try:
        Session(model, gpu=gpu).estimate(batch_size=batch_size, seq_len=seq_len, **QLORA)
    finally:
        pipeline.apply_device = original
    return caught[-1]


def best_of(repeats: int, work: Callable[[], object]) -> tuple[float, object]:
    """The least CPU seconds of ``repeats`` runs, and the last run's result."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.process_time()
        with quiet():
            result = work()
        best = min(best, time.process_time() - start)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="hf:meta-llama/Meta-Llama-3-70B")
    parser.add_argument("--gpu", default="a100-80gb")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    (estimate, trace, options), kwargs = caught_call(
        args.model, args.gpu, args.batch_size, args.seq_len
    )
    requests = requests_of(trace)
    seconds, replayed = best_of(
        args.repeats, lambda: Replay(AllocatorConfig.parse(options.alloc_conf)).run(requests)
    )
    print(
        f"allocator replay: {len(requests):,} requests in {seconds:.3f} s "
        f"({seconds / len(requests) * 1e6:.2f} us each), peak reserved "
        f"{replayed.stats.peak_reserved:,} B"
    )
    seconds, result = best_of(
        args.repeats, lambda: pipeline.apply_device(estimate, trace, options, **kwargs)
    )
    print(
        f"apply_device: {seconds:.3f} s, device total {result.peak.device_total_bytes:,} B, "
        f"range {result.peak.device_total_range_bytes}"
    )


if __name__ == "__main__":
    main()
