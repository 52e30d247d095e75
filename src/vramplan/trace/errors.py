"""Turn a failure inside a traced model into one line a user can act on.

>>> print(explain_failure(RuntimeError("bad shapes"), "m.py:net"))
model m.py:net failed on the example batch: bad shapes (check --input-shape / --seq-len)
"""

from __future__ import annotations

from torch._subclasses import fake_tensor

from vramplan.errors import UserError, cuda_hint

_FAKE_LIMITS = tuple(
    getattr(fake_tensor, name)
    for name in (
        "DataDependentOutputException",
        "DynamicOutputShapeException",
        "UnsupportedOperatorException",
        "UnsupportedFakeTensorException",
    )
    if hasattr(fake_tensor, name)
)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def explain_failure(
    exc: BaseException, model_name: str, hint: str = "check --input-shape / --seq-len"
) -> UserError:
    """A ``UserError`` naming the op that cannot run without real data, or the error."""
    if isinstance(exc, UserError):
        return exc
    if isinstance(exc, _FAKE_LIMITS):
        op = getattr(exc, "func", None)
        return UserError(
            f"model {model_name} reads a tensor's value (op {op}: .item(), a Python `if` on a "
            "tensor, nonzero or a data-dependent shape); vramplan traces on the CPU with fake "
            "tensors, which have shapes but no values: keep that value a tensor (torch.where, "
            "a mask) or move the data-dependent path out of forward"
        )
    if isinstance(exc, SystemExit):
        return UserError(f"model {model_name} called sys.exit({exc.code}) while tracing")
    if "Expected more than 1 value per channel when training" in str(exc):
        return UserError(
            f"model {model_name} failed on the example batch: {_first_line(exc)}: a BatchNorm "
            "in training sees one value per channel (batch x height x width = 1 where it "
            "runs, as after a global pool at batch 1), which a real step refuses too; raise "
            "--batch-size (or the input size)"
        )
    if "Float16 grouped_mm requires cuBLASLt grouped GEMM support" in str(exc):
        return UserError(
            f"model {model_name} failed on the example batch: {_first_line(exc)} PyTorch runs "
            "an fp16 grouped matmul (transformers' default mixture-of-experts kernel) only "
            "through cuBLASLt's grouped GEMM, with CUDA 13.3 or later on sm90-sm11x, so a real "
            "fp16 step fails on other stacks too; use --precision bf16 or amp-bf16, or "
            "--experts eager where the experts allow it"
        )
    if "Expected mat_a to be BFloat16 or supported Float16 matrix" in str(exc):
        return UserError(
            f"model {model_name} failed on the example batch: {_first_line(exc)} PyTorch's "
            "grouped matmul (transformers' default mixture-of-experts kernel) takes bf16 or "
            "fp16 only, and autocast does not cast for it, so a real fp32 or amp step fails "
            "too; use --precision bf16, or --experts eager"
        )
    if "FSDP expects uniform original parameter dtype" in str(exc):
        return UserError(
            f"model {model_name} failed on the example batch: {_first_line(exc)}: FSDP2 "
            "all-gathers one dtype per sharded unit, and this half-precision model keeps some "
            "weights in fp32 (transformers' _keep_in_fp32_modules, or --keep-fp32), which a "
            "real run refuses too; train in fp32 weights with --precision amp-fp16 or amp-bf16"
        )
    gpu_hint = cuda_hint(exc)
    if gpu_hint:
        return UserError(f"model {model_name} wants a GPU ({_first_line(exc)}){gpu_hint}")
    if isinstance(exc, (RuntimeError, ValueError, TypeError, IndexError, AssertionError)):
        return UserError(
            f"model {model_name} failed on the example batch: {_first_line(exc)} ({hint})"
        )
    return UserError(
        f"model {model_name} failed while tracing: {type(exc).__name__}: {_first_line(exc)}"
    )
