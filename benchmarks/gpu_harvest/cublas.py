"""cuBLAS and cuBLASLt workspaces, one per (handle, stream): what the first matmul leaves
allocated on the default stream, on a second stream, on a second thread (a new handle; the
autograd engine runs backward on its own thread) and under autograd, fp32 and bf16. Runs in
a fresh process so every first call is a first call::

    python -m benchmarks.gpu_harvest.cublas        # prints its figures as JSON

Each case records the allocations the call left live that are not its outputs, and which
library they came from, read from the allocation's C++ frames::

    >>> classify([{"name": "at::cuda::getCUDABlasLtWorkspace()"}])
    'cublasLt'
    >>> classify([{"name": "at::cuda::(anonymous namespace)::getNewWorkspace()"},
    ...           {"name": "at::cuda::getCUDABlasLtWorkspace()"}])
    'cublas'
"""

from __future__ import annotations

import os
import sys
import threading

ENV_KNOBS = (
    "CUBLAS_WORKSPACE_CONFIG",
    "CUBLASLT_WORKSPACE_SIZE",
    "TORCH_CUBLASLT_UNIFIED_WORKSPACE",
    "TORCH_BLAS_PREFER_CUBLASLT",
    "CUDA_MODULE_LOADING",
)


def classify(frames: list[dict] | None) -> str:
    """'cublasLt', 'cublas' or 'unknown' from an allocation's stack frames (innermost first,
    as PyTorch records them: the first library frame decides)."""
    for frame in frames or []:
        name = str(frame.get("name", ""))
        if "BlasLt" in name or "cublasLt" in name:
            return "cublasLt"
        if "Blas" in name or "cublas" in name or "getNewWorkspace" in name:
            return "cublas"
    return "unknown"


def _storages(result) -> set[int]:
    import torch

    items = result if isinstance(result, (tuple, list)) else [result]
    return {t.untyped_storage().data_ptr() for t in items if isinstance(t, torch.Tensor)}


def _case(name: str, call) -> dict:
    """Run ``call`` recorded; keep the live non-output allocations as workspaces."""
    import torch

    from benchmarks.gpu_harvest.recording import record_call

    before = torch.cuda.memory_allocated()
    result, facts = record_call(call, frames=True)
    frames = {}
    for event in facts["events"]:
        if event.get("action") == "alloc":
            frames[event["addr"]] = event.get("frames")
    outputs = _storages(result)
    workspaces = [
        {"bytes": size, "kind": classify(frames.get(addr))}
        for addr, size in facts["window"].live
        if addr not in outputs
    ]
    del result
    torch.cuda.synchronize()
    return {
        "case": name,
        "workspaces": workspaces,
        "workspace_bytes": sum(w["bytes"] for w in workspaces),
        "allocated_growth": int(torch.cuda.memory_allocated() - before),
        "oom": facts["oom"],
        "window": facts["window"].to_json(),
    }


def _on_thread(call):
    box = {}

    def target():
        box["result"] = call()

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    return box["result"]


def run_cases() -> dict:
    import torch

    torch.cuda.init()
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    inputs = {
        key: torch.randn(256, 256, device="cuda", dtype=dtype) for key, dtype in dtypes.items()
    }
    bias = {key: torch.randn(256, device="cuda", dtype=dtype) for key, dtype in dtypes.items()}
    stream = torch.cuda.Stream()
    cases = []
    for key in dtypes:
        a = inputs[key]
        cases.append(_case(f"default_stream_{key}", lambda a=a: torch.mm(a, a)))
    for key in dtypes:
        a = inputs[key]

        def on_stream(a=a):
            with torch.cuda.stream(stream):
                out = torch.mm(a, a)
            stream.synchronize()
            return out

        cases.append(_case(f"second_stream_{key}", on_stream))
    for key in dtypes:
        a = inputs[key]
        cases.append(_case(f"second_thread_{key}", lambda a=a: _on_thread(lambda: torch.mm(a, a))))
    for key in dtypes:  # addmm with a bias: the cuBLASLt epilogue path
        a, b = inputs[key], bias[key]
        cases.append(
            _case(f"linear_bias_{key}", lambda a=a, b=b: torch.nn.functional.linear(a, a, b))
        )
    for key, dtype in dtypes.items():  # backward on the autograd engine's device thread
        leaf = torch.randn(256, 256, device="cuda", dtype=dtype, requires_grad=True)

        def backward(leaf=leaf):
            (leaf @ leaf).sum().backward()
            return leaf.grad

        cases.append(_case(f"autograd_backward_{key}", backward))
    preferred = getattr(torch.backends.cuda, "preferred_blas_library", None)
    return {
        "cases": cases,
        "env": {knob: os.environ.get(knob) for knob in ENV_KNOBS},
        "preferred_blas_library": str(preferred()) if preferred else None,
        "allocated_after": int(torch.cuda.memory_allocated()),
    }


def summary(result: dict) -> dict:
    """The ``cublas`` section of the measured file from ``run_cases()``'s result."""
    per_handle = {case["case"]: case["workspace_bytes"] for case in result.get("cases", [])}
    sizes = {"cublas": [], "cublasLt": []}
    for case in result.get("cases", []):
        for workspace in case["workspaces"]:
            if workspace["kind"] in sizes:
                sizes[workspace["kind"]].append(workspace["bytes"])
    first = per_handle.get("default_stream_fp32")
    return {
        "cublas_workspace_bytes": max(sizes["cublas"]) if sizes["cublas"] else first,
        "cublaslt_workspace_bytes": max(sizes["cublasLt"]) if sizes["cublasLt"] else None,
        "per_handle": per_handle,
    }


def main() -> int:
    from benchmarks.gpu_harvest.child import emit

    emit(run_cases())
    return 0


if __name__ == "__main__":
    sys.exit(main())
