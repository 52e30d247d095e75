"""What one op costs under fake tensors, and what the recorder adds to it (prints only).

A trace is a few thousand ops, each dispatched to a fake mode through the recorder
(``trace/recorder.py``), so the cost of one op sets the cost of a trace. Loops over the
same five ops (``add``, ``mm``, ``view``, ``silu``, ``t``) on 64x64 fake CUDA tensors, a
batched ``matmul`` (it ends in ``_unsafe_view``), ``item()`` of a constant (the optimizer's
step counts) and a device query (``prim.device``, what C++ asks a fake tensor most often),
under PyTorch's ``FakeTensorMode`` and under the keyed mode traces run in
(``trace/fake_mode.py``), each the best of ``--repeats``::

    python -m benchmarks.speed.dispatch
    python -m benchmarks.speed.dispatch --calls 2000 --repeats 9
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from vramplan.trace.fake_mode import KeyedFakeTensorMode
from vramplan.trace.recorder import AllocationRecorder


class PassThrough(TorchDispatchMode):
    """A dispatch mode that only runs each op: the cost of one more Python mode."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def five_ops(a: torch.Tensor, w: torch.Tensor) -> None:
    c = a @ w
    _ = (a + a, c.view(-1), torch.nn.functional.silu(c), c.t())


def batched_matmul(a: torch.Tensor, w: torch.Tensor) -> None:
    _ = a.view(4, 16, 64) @ w


def constant_item(a: torch.Tensor, w: torch.Tensor) -> None:
    _ = torch.ops.aten._local_scalar_dense.default(a.step)


def device_query(a: torch.Tensor, w: torch.Tensor) -> None:
    torch.ops.prim.device.default(a)


def per_call_us(
    body: Callable, calls: int, repeats: int, mode: type[FakeTensorMode], above: Callable
) -> float:
    """Best microseconds per op of ``body`` under a fresh ``mode`` and ``above()`` (a
    context entered over it)."""
    ops = 5 if body is five_ops else 1
    best = float("inf")
    for _ in range(repeats):
        with mode():
            a = torch.empty(64, 64, device="cuda")
            w = torch.empty(64, 64, device="cuda")
            a.step = torch.tensor(3.0)  # a constant, as an optimizer's step count
            with above():
                start = time.perf_counter()
                for _ in range(calls):
                    body(a, w)
                best = min(best, time.perf_counter() - start)
    return best / calls / ops * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    modes = {"PyTorch's mode": FakeTensorMode, "keyed mode": KeyedFakeTensorMode}
    layers = {
        "alone": contextlib.nullcontext,
        "+ a pass-through mode": PassThrough,
        "+ the recorder": AllocationRecorder,
    }
    bodies = {
        "an op": five_ops,
        "a batched matmul": batched_matmul,
        "item() of a constant": constant_item,
        "a device query": device_query,
    }
    print(f"torch {torch.__version__}; best of {args.repeats}, {args.calls} calls each")
    for label, body in bodies.items():
        for mode_name, mode in modes.items():
            for name, above in layers.items():
                cost = per_call_us(body, args.calls, args.repeats, mode, above)
                print(f"{label:21s} {mode_name:15s} {name:22s} {cost:8.1f} us")


if __name__ == "__main__":
    main()
