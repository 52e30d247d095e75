"""cuDNN convolution workspaces per configuration and pass (forward, backward-data,
backward-filter), attributed from the caching allocator's own trace: the largest allocation
a call makes and frees before it returns is its workspace. Each case is called twice (the
first call picks and caches a plan, the second reuses it). One process per
``torch.backends.cudnn.benchmark`` setting, because PyTorch's plan cache does not key on it::

    python -m benchmarks.gpu_harvest.conv_workspace --plan plan.json --out conv.jsonl \\
        --benchmark 1 --budget-s 120

``plan.json`` lists cases: a configuration from ``conv_shapes`` with ``dtype`` and
``memory_format``. Every call becomes one JSON line of ``--out`` as soon as it is measured.

    >>> import torch
    >>> config = {"input": [2, 3, 8, 8], "weight": [4, 3, 3, 3], "stride": [1, 1],
    ...           "padding": [1, 1], "dilation": [1, 1], "groups": 1}
    >>> x, w, g = make_tensors(config, torch.float32, "contiguous", "cpu")
    >>> [tuple(t.shape) for t in conv_call("backward_filter", x, w, g, config)() if t is not None]
    [(4, 3, 3, 3)]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.gpu_harvest.conv_shapes import output_shape

PASSES = ("forward", "backward_data", "backward_filter")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MEMORY_FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}
CONFIG_FIELDS = ("input", "weight", "stride", "padding", "dilation", "groups")


def plan_cases(configs: list[dict], dtypes=("float32",), memory_formats=("contiguous",)):
    """One case per configuration, dtype and memory format (configurations outermost by
    batch size as given, then dtype)."""
    batches: dict[int, list[dict]] = {}
    for config in configs:
        batches.setdefault(config["input"][0], []).append(config)
    cases = []
    for batch_configs in batches.values():
        for dtype in dtypes:
            for memory_format in memory_formats:
                for config in batch_configs:
                    case = {key: config[key] for key in CONFIG_FIELDS}
                    case.update(dtype=dtype, memory_format=memory_format)
                    case["models"] = config.get("models", [])
                    cases.append(case)
    return cases


def make_tensors(config: dict, dtype, memory_format: str, device: str = "cuda"):
    """Input, weight and output-gradient tensors of a case."""
    fmt = MEMORY_FORMATS[memory_format]

    def tensor(shape):
        return torch.randn(shape, dtype=dtype, device=device).contiguous(memory_format=fmt)

    return tensor(config["input"]), tensor(config["weight"]), tensor(output_shape(config))


def conv_call(pass_name: str, x, weight, grad_output, config: dict):
    """A zero-argument callable running one pass of the convolution."""
    args = (config["stride"], config["padding"], config["dilation"])
    zeros = [0] * len(config["stride"])  # output padding; 2-d and 3-d alike
    if pass_name == "forward":
        return lambda: torch.ops.aten.convolution(
            x, weight, None, *args, False, zeros, config["groups"]
        )
    mask = {"backward_data": [True, False, False], "backward_filter": [False, True, False]}
    output_mask = mask[pass_name]
    return lambda: torch.ops.aten.convolution_backward(
        grad_output, x, weight, None, *args, False, zeros, config["groups"], output_mask
    )


def measure_case(case: dict, benchmark: bool, calls: int = 2) -> list[dict]:
    """Every pass of one case, ``calls`` times each, recorded."""
    from benchmarks.gpu_harvest.recording import record_call

    records = []
    base = {key: case[key] for key in (*CONFIG_FIELDS, "dtype", "memory_format", "models")}
    try:
        x, weight, grad_output = make_tensors(case, DTYPES[case["dtype"]], case["memory_format"])
    except torch.cuda.OutOfMemoryError as exc:
        torch.cuda.empty_cache()
        return [{**base, "benchmark": benchmark, "setup_oom": str(exc).splitlines()[0][:300]}]
    for pass_name in PASSES:
        call = conv_call(pass_name, x, weight, grad_output, case)
        for number in range(1, calls + 1):
            result, facts = record_call(call)
            del result
            window = facts["window"]
            records.append(
                {
                    **base,
                    "pass": pass_name,
                    "benchmark": benchmark,
                    "call": number,
                    "workspace_bytes": window.workspace_bytes,
                    "reserved_growth_bytes": facts["peak_reserved_growth"],
                    "allocated_growth_bytes": facts["peak_allocated_growth"],
                    "cache_emptied": window.cache_emptied,
                    "oom": facts["oom"],
                    "seconds": facts["seconds"],
                    "wrapped": facts["wrapped"],
                    "trace": window.to_json(),
                }
            )
    del x, weight, grad_output
    return records


def run(plan: list[dict], benchmark: bool, out: Path, budget_s: float) -> dict:
    torch.cuda.init()
    torch.backends.cudnn.benchmark = benchmark
    deadline = time.monotonic() + budget_s
    done = records = errors = 0
    with out.open("a") as handle:
        for case in plan:
            if time.monotonic() > deadline:
                break
            try:
                found = measure_case(case, benchmark)
            except RuntimeError as exc:  # e.g. no cuDNN engine for this case: note it, go on
                found = [{**case, "benchmark": benchmark, "error": str(exc).splitlines()[0]}]
                errors += 1
            for record in found:
                handle.write(json.dumps(record) + "\n")
                records += 1
            handle.flush()
            done += 1
    return {
        "benchmark": benchmark,
        "cases_planned": len(plan),
        "cases_done": done,
        "records": records,
        "errors": errors,
        "cudnn": {
            "version": torch.backends.cudnn.version(),
            "enabled": torch.backends.cudnn.enabled,
            "deterministic": torch.backends.cudnn.deterministic,
            "allow_tf32": torch.backends.cudnn.allow_tf32,
        },
    }


def main(argv: list[str] | None = None) -> int:
    from benchmarks.gpu_harvest.child import emit

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--benchmark", type=int, choices=[0, 1], required=True)
    parser.add_argument("--budget-s", type=float, default=120.0)
    options = parser.parse_args(argv)
    plan = json.loads(options.plan.read_text())
    emit(run(plan, bool(options.benchmark), options.out, options.budget_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
