"""What cuDNN's recurrent layers allocate on this card: every caching-allocator request of
one training forward and one backward of ``nn.LSTM`` / ``nn.GRU`` over a grid of shapes,
read off ``torch.cuda.memory._record_memory_history``::

    python -m benchmarks.gpu_harvest.rnn_workspace --out rnn_workspace.json

The trace runs PyTorch's native CUDA cells in their place (``trace/cuda_rnn.py``): cuDNN
publishes neither its reserve buffer (kept from forward to backward) nor its workspace, so
these records are what a model of them has to match. Each record: the case, and per pass
the request sizes, each marked ``kept`` (alive when the call returns) or not, in order.

    >>> CASES[0].name
    'lstm-l2-b16-t64-i128-h256-fp32'
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.gpu_harvest.sdpa_workspace import events_since, requests_in


@dataclass(frozen=True)
class Case:
    """One recurrent layer stack and its (batch, time, input) batch."""

    kind: str
    layers: int
    batch: int
    time: int
    features: int
    hidden: int
    dtype: str = "float32"
    bidirectional: bool = False

    @property
    def name(self) -> str:
        short = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[self.dtype]
        both = "-bi" if self.bidirectional else ""
        return (
            f"{self.kind}-l{self.layers}-b{self.batch}-t{self.time}-i{self.features}"
            f"-h{self.hidden}-{short}{both}"
        )


CASES = (
    Case("lstm", 2, 16, 64, 128, 256),  # the accuracy study's LSTM classifier
    Case("lstm", 1, 16, 64, 128, 256),
    Case("lstm", 2, 32, 128, 512, 512),
    Case("lstm", 2, 8, 512, 256, 1024),
    Case("lstm", 1, 64, 32, 1024, 1024),
    Case("lstm", 2, 32, 128, 512, 512, bidirectional=True),
    Case("lstm", 2, 32, 128, 512, 512, "float16"),
    Case("lstm", 2, 32, 128, 512, 512, "bfloat16"),
    Case("lstm", 4, 16, 256, 256, 512),
    Case("gru", 2, 16, 64, 128, 256),
    Case("gru", 2, 32, 128, 512, 512),
    Case("gru", 2, 32, 128, 512, 512, bidirectional=True),
)


def run_case(torch, case: Case) -> dict:
    """One training forward and backward of ``case``."""
    dtype = getattr(torch, case.dtype)
    layer = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}[case.kind]
    module = layer(
        case.features,
        case.hidden,
        num_layers=case.layers,
        batch_first=True,
        bidirectional=case.bidirectional,
    ).to("cuda", dtype)
    x = torch.randn(case.batch, case.time, case.features, device="cuda", dtype=dtype)
    x.requires_grad_(True)
    torch.cuda.synchronize()
    record: dict = {"case": case.name, **asdict(case)}
    start = len(events_since(torch, 0))
    out, _ = module(x)
    torch.cuda.synchronize()
    record["forward"] = requests_in(events_since(torch, start))
    grad = torch.randn_like(out)
    start = len(events_since(torch, 0))
    out.backward(grad)
    torch.cuda.synchronize()
    record["backward"] = requests_in(events_since(torch, start))
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    options = parser.parse_args(argv)
    import torch

    torch.cuda.init()
    torch.cuda.memory._record_memory_history(max_entries=200_000, context=None, stacks="python")
    records = []
    for case in CASES:
        try:
            records.append(run_case(torch, case))
        except (RuntimeError, TypeError, ValueError) as exc:  # recorded, the others go on
            records.append({"case": case.name, "error": str(exc).splitlines()[0][:200]})
        torch.cuda.empty_cache()
        line = records[-1]
        brief = {
            p: [(round(r["size"] / 2**20, 3), r["kept"]) for r in line.get(p, [])]
            for p in ("forward", "backward")
        }
        print(case.name, line.get("error", brief))
    versions = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
    }
    options.out.write_text(json.dumps({"versions": versions, "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
