"""What each fused SDPA kernel allocates on this card besides its outputs: every request
the caching allocator sees during one forward and one backward call of
``F.scaled_dot_product_attention`` under each backend (cuDNN, flash, memory-efficient), for
a grid of shapes, read off ``torch.cuda.memory._record_memory_history``::

    python -m benchmarks.gpu_harvest.sdpa_workspace --out sdpa_workspace.json

The kernels' meta functions return only their outputs; what the CUDA implementation
allocates and frees inside the call (cuDNN's workspace, flash's ``dq_accum`` and
``softmax_d``, grouped-query dK/dV expanded to every query head) is invisible on the CPU.
Each record: the case, the kernel ``torch._fused_sdp_choice`` picks by default, and per
pass the request sizes, each marked ``kept`` (alive when the call returns: outputs) or
``freed`` (freed before it returns: temporaries), in order.

    >>> [case.name for case in CASES][:1]
    ['b8-h14-kv2-s1024-d64-causal-bf16']
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass

from benchmarks.gpu_harvest.probe import requests_of, run_probe

BACKENDS = ("cudnn", "flash", "efficient")


@dataclass(frozen=True)
class Case:
    """One SDPA call's shape: (batch, query heads, key/value heads, length, head dim)."""

    batch: int
    heads: int
    kv_heads: int
    seq: int
    head_dim: int
    causal: bool
    dtype: str = "bfloat16"
    dropout: float = 0.0
    layout: str = "bhsd"
    """``bhsd``: q, k, v and the output's gradient contiguous as (batch, heads, length, dim);
    ``bshd``: (batch, length, heads, dim) transposed to that shape, as transformers' models
    make them (a projection's output viewed per head)."""

    @property
    def name(self) -> str:
        mask = "causal" if self.causal else "full"
        drop = f"-p{self.dropout:g}" if self.dropout else ""
        dtype = {"bfloat16": "bf16", "float16": "fp16"}[self.dtype]
        return (
            f"b{self.batch}-h{self.heads}-kv{self.kv_heads}-s{self.seq}-d{self.head_dim}"
            f"-{mask}-{dtype}{drop}{'-bshd' if self.layout == 'bshd' else ''}"
        )


CASES = (
    Case(8, 14, 2, 1024, 64, True),  # Qwen2.5-0.5B at batch 8, 1024 tokens
    Case(8, 14, 14, 1024, 64, True),
    Case(8, 14, 2, 2048, 64, True),
    Case(4, 14, 2, 1024, 64, True),
    Case(4, 32, 8, 2048, 128, True),  # Llama-3-8B's heads
    Case(2, 32, 8, 4096, 128, True),
    Case(1, 32, 32, 2048, 128, True),
    Case(4, 32, 32, 2048, 80, True),  # Phi-2
    Case(4, 8, 4, 1024, 256, True),  # Gemma-2-2B
    Case(8, 12, 12, 512, 64, False),  # BERT-base
    Case(8, 12, 12, 512, 64, False, dropout=0.1),
    Case(8, 12, 12, 1024, 64, True),  # GPT-2
    Case(8, 12, 12, 1024, 64, True, dropout=0.1),
    Case(32, 12, 12, 256, 64, False, "float16"),  # RoBERTa amp-fp16
    Case(8, 16, 16, 4096, 64, True),
    Case(16, 16, 16, 197, 64, False),  # ViT-B/16 at 224
    Case(8, 14, 2, 1000, 64, True),  # a length off the tiles
    Case(8, 14, 2, 1024, 64, True, "float16"),
    Case(8, 14, 2, 1024, 64, True, layout="bshd"),
    Case(8, 14, 14, 1024, 64, True, layout="bshd"),
    Case(4, 32, 8, 2048, 128, True, layout="bshd"),
    Case(8, 12, 12, 512, 64, False, dropout=0.1, layout="bshd"),
    Case(16, 16, 16, 197, 64, False, layout="bshd"),
    Case(4, 32, 32, 2048, 80, True, layout="bshd"),
)


def measure_case(torch, case: Case, backend: str) -> dict:
    """One forward and one backward call of ``case`` under ``backend``."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    chosen["efficient"] = SDPBackend.EFFICIENT_ATTENTION
    dtype = getattr(torch, case.dtype)
    shape_q = (case.batch, case.heads, case.seq, case.head_dim)
    shape_kv = (case.batch, case.kv_heads, case.seq, case.head_dim)

    def made(shape, grad=True):
        if case.layout == "bhsd":
            return torch.randn(shape, device="cuda", dtype=dtype, requires_grad=grad)
        b, h, s, d = shape
        base = torch.randn((b, s, h, d), device="cuda", dtype=dtype, requires_grad=grad)
        return base, base.transpose(1, 2)

    if case.layout == "bhsd":
        q, k, v = made(shape_q), made(shape_kv), made(shape_kv)
    else:
        q, k, v = (view for _, view in (made(shape_q), made(shape_kv), made(shape_kv)))
    gqa = case.heads != case.kv_heads
    kwargs = {"dropout_p": case.dropout, "is_causal": case.causal}
    if gqa:
        kwargs["enable_gqa"] = True
    grad = made(shape_q, False) if case.layout == "bhsd" else made(shape_q, False)[1]
    torch.cuda.synchronize()
    record: dict = {"case": case.name, "backend": backend, **asdict(case)}
    try:
        default = torch._fused_sdp_choice(q, k, v, None, case.dropout, case.causal, enable_gqa=gqa)
        record["default_choice"] = int(default)
        with sdpa_kernel([chosen[backend]]):
            forward = lambda: F.scaled_dot_product_attention(q, k, v, **kwargs)  # noqa: E731
            record["forward"], out = requests_of(torch, forward)
            record["backward"], _ = requests_of(torch, lambda: out.backward(grad))
    except (RuntimeError, TypeError, ValueError) as exc:  # a kernel that refuses the case
        record["error"] = str(exc).splitlines()[0][:200]
    return record


def measured(torch) -> Iterator[dict]:
    """Every case under every backend."""
    for case in CASES:
        for backend in BACKENDS:
            yield measure_case(torch, case, backend)


def brief(record: dict) -> str:
    """The case, the backend, the default choice, and the scratch MiB per pass."""
    scratch = {
        p: [round(r["size"] / 2**20, 3) for r in record.get(p, []) if not r["kept"]]
        for p in ("forward", "backward")
    }
    return f"{record['case']} {record['backend']} {record.get('default_choice')} " + str(
        record.get("error", scratch)
    )


def main(argv: list[str] | None = None) -> int:
    return run_probe(__doc__, argv, measured, brief)


if __name__ == "__main__":
    raise SystemExit(main())
