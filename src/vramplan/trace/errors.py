"""Turn a failure inside a traced model into one line a user can act on.

>>> print(explain_failure(RuntimeError("bad shapes"), "m.py:net"))
model m.py:net failed on the example batch: bad shapes (check --input-shape / --seq-len)
"""

from __future__ import annotations

from torch._subclasses import fake_tensor

from vramplan.errors import UserError

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


def explain_failure(exc: BaseException, model_name: str) -> UserError:
    """A ``UserError`` naming the op that cannot run without real data, or the error."""
    if isinstance(exc, UserError):
        return exc
    if isinstance(exc, _FAKE_LIMITS):
        op = getattr(exc, "func", None)
        return UserError(
            f"model {model_name} cannot run under fake tensors: op {op} needs real data values "
            "(e.g. .item(), nonzero or data-dependent shapes); make that path static or "
            "estimate with vramplan.estimate_step() around a step that avoids it"
        )
    if isinstance(exc, (RuntimeError, ValueError, TypeError, IndexError, AssertionError)):
        return UserError(
            f"model {model_name} failed on the example batch: {_first_line(exc)} "
            "(check --input-shape / --seq-len)"
        )
    return UserError(
        f"model {model_name} failed while tracing: {type(exc).__name__}: {_first_line(exc)}"
    )
