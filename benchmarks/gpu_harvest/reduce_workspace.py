"""What PyTorch's CUDA reductions allocate besides their output: ``gpu_reduce_kernel``
(``aten/src/ATen/native/cuda/Reduce.cuh``) splits a long reduction across thread blocks
and then asks the caching allocator for a staging buffer and a semaphore array, freed
when the call returns. A bias's gradient (``grad.sum(0)`` over every token) or a norm
weight's is such a reduction; the meta kernel shows only the output::

    python -m benchmarks.gpu_harvest.reduce_workspace --out reduce_workspace.json

Each record: the case, and the sizes the call allocated, each marked ``kept`` (the
output) or ``freed`` (scratch), in order, with the card's multiprocessor count and
threads per multiprocessor (the split depends on them).

    >>> CASES[0].name
    'sum-8192x896-d0-bf16'
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.gpu_harvest.probe import each_case, requests_of, run_probe


@dataclass(frozen=True)
class Case:
    """One reduction: ``op`` over ``dims`` of a tensor of ``shape``."""

    op: str
    shape: tuple[int, ...]
    dims: tuple[int, ...] | None
    dtype: str = "bfloat16"
    channels_last: bool = False

    @property
    def name(self) -> str:
        dims = "all" if self.dims is None else "".join(str(d) for d in self.dims)
        short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[self.dtype]
        cl = "-cl" if self.channels_last else ""
        return f"{self.op}-{'x'.join(map(str, self.shape))}-d{dims}-{short}{cl}"


CASES = (
    Case("sum", (8192, 896), (0,)),  # Qwen2.5-0.5B q bias / norm weight at 8x1024 tokens
    Case("sum", (8192, 128), (0,)),
    Case("sum", (8, 1024, 896), (0, 1)),
    Case("sum", (8192, 896), (0,), "float32"),
    Case("sum", (8192, 896), (0,), "float16"),
    Case("sum", (4096, 3072), (0,), "float32"),  # BERT-base FFN bias at 8x512
    Case("sum", (4096, 768), (0,), "float32"),
    Case("sum", (4096, 2304), (0,), "float32"),  # GPT-2 c_attn bias
    Case("sum", (512, 768), (0,), "float32"),
    Case("sum", (64, 1000), (0,), "float32"),  # a classifier bias
    Case("sum", (32768, 4096), (0,)),
    Case("sum", (100, 4096), (0,)),
    Case("sum", (2048, 50257), (0,), "float32"),  # an odd width: no vectorized output
    Case("sum", (16384, 1), (0,), "float32"),
    Case("sum", (8192, 896), (1,)),  # along the fastest dimension
    Case("sum", (8192, 896), None),
    Case("sum", (32, 256, 56, 56), (0, 2, 3), "float32"),  # a convolution bias
    Case("sum", (32, 256, 56, 56), (0, 2, 3), "float16", True),
    Case("mean", (8192, 896), (0,)),
    Case("amax", (8192, 896), (0,)),
    Case("var_mean", (8192, 896), (0,), "float32"),
    Case("norm", (8192, 896), None),
    Case("conv_bias_backward", (8, 256, 56, 56), None, "float32"),
    Case("conv_backward", (8, 256, 56, 56), None, "float32"),
    Case("layer_norm_backward", (8192, 768), None, "float32"),
    Case("layer_norm_backward", (8192, 896), None),
    Case("layer_norm_backward", (65536, 4096), None),
    Case("batch_norm_backward", (32, 256, 56, 56), None, "float32"),
    Case("embedding_backward", (8192, 896), None),
)
"""``*_backward``: a module's forward on an input of ``shape`` (the embedding: ``shape[0]``
token ids into a ``shape[1]``-wide table of 151936 rows), then its backward."""


def backward_requests(torch, case: Case) -> list[dict]:
    """The requests of one backward call through the module ``case.op`` names."""
    nn, dtype = torch.nn, getattr(torch, case.dtype)
    if case.op == "embedding_backward":
        module = nn.Embedding(151936, case.shape[1]).to("cuda", dtype)
        x = torch.randint(0, 151936, (case.shape[0],), device="cuda")
    else:
        channels = case.shape[1] if len(case.shape) == 4 else case.shape[-1]
        module = {
            "conv_bias_backward": lambda: nn.Conv2d(channels, channels, 3, padding=1),
            "conv_backward": lambda: nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            "layer_norm_backward": lambda: nn.LayerNorm(channels),
            "batch_norm_backward": lambda: nn.BatchNorm2d(channels),
        }[case.op]().to("cuda", dtype)
        x = torch.randn(case.shape, device="cuda", dtype=dtype, requires_grad=True)
    out = module(x)
    grad = torch.randn_like(out)
    torch.cuda.synchronize()
    return requests_of(torch, lambda: out.backward(grad))[0]


def run_case(torch, case: Case) -> dict:
    if case.op.endswith("_backward"):
        return {"case": case.name, "requests": backward_requests(torch, case)}
    dtype = getattr(torch, case.dtype)
    x = torch.randn(case.shape, device="cuda", dtype=dtype)
    if case.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    dims = case.dims
    ops = {
        "sum": lambda: x.sum(dims) if dims is not None else x.sum(),
        "mean": lambda: x.mean(dims),
        "amax": lambda: x.amax(dims),
        "var_mean": lambda: torch.var_mean(x, dims),
        "norm": lambda: torch.linalg.vector_norm(x),
    }
    torch.cuda.synchronize()
    return {"case": case.name, "requests": requests_of(torch, ops[case.op])[0]}


def brief(record: dict) -> str:
    """The case and its scratch requests (bytes)."""
    scratch = [r["size"] for r in record.get("requests", []) if not r["kept"]]
    return f"{record['case']} {record.get('error', scratch)}"


def main(argv: list[str] | None = None) -> int:
    return run_probe(__doc__, argv, each_case(CASES, run_case), brief)


if __name__ == "__main__":
    raise SystemExit(main())
