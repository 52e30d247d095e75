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

from dataclasses import asdict, dataclass

from benchmarks.gpu_harvest.probe import each_case, requests_of, run_probe


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
    record["forward"], (out, _) = requests_of(torch, lambda: module(x))
    grad = torch.randn_like(out)
    record["backward"], _ = requests_of(torch, lambda: out.backward(grad))
    return record


def brief(record: dict) -> str:
    """The case and its requests (MiB, kept) per pass."""
    passes = {
        p: [(round(r["size"] / 2**20, 3), r["kept"]) for r in record.get(p, [])]
        for p in ("forward", "backward")
    }
    return f"{record['case']} {record.get('error', passes)}"


def main(argv: list[str] | None = None) -> int:
    return run_probe(__doc__, argv, each_case(CASES, run_case), brief)


if __name__ == "__main__":
    raise SystemExit(main())
