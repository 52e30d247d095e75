"""A time limit on the user's code: factories, imports and traced steps.

A factory that never returns would hang a command with no word; ``time_limit`` turns that
into one line naming what did not return. The limit is set per question by the Session
(``Session(timeout=300)``, ``--timeout``) and read where user code runs::

    with user_code_timeout(1.0):
        with time_limit("factory net.py:make"):
            factory()      # UserError after 1 s: factory net.py:make did not return ...

It uses ``SIGALRM``, so it acts in the main thread on POSIX systems; elsewhere code runs
without a limit.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import signal
import threading
from collections.abc import Iterator

from vramplan.errors import UserError

DEFAULT_TIMEOUT = 300.0
_timeout: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "vramplan_user_code_timeout", default=DEFAULT_TIMEOUT
)


class _Expired(BaseException):
    """Raised inside the user's code when the limit passes (a BaseException, so the
    user's own ``except Exception`` does not swallow it)."""


def check_timeout(seconds: float | None) -> float | None:
    """``seconds`` validated: a positive number, or None for no limit."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise UserError(f"timeout must be a number of seconds, got {seconds!r}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise UserError(f"timeout must be a positive number of seconds, got {seconds}")
    return float(seconds)


@contextlib.contextmanager
def user_code_timeout(seconds: float | None) -> Iterator[None]:
    """Set the limit each piece of user code gets while inside this block."""
    token = _timeout.set(check_timeout(seconds))
    try:
        yield
    finally:
        _timeout.reset(token)


def user_code_limit() -> float | None:
    """The limit each piece of user code gets here now (None: none).

    >>> with user_code_timeout(30):
    ...     user_code_limit()
    30.0
    """
    return _timeout.get()


def _usable() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def time_limit(what: str) -> Iterator[None]:
    """Run the block under the current limit; a UserError naming ``what`` when it passes.
    Nested limits keep the outer one running (the inner one does not start)."""
    seconds = user_code_limit()
    if seconds is None or not _usable() or signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        yield
        return

    armed = [True]

    def expire(_signum, _frame):
        if armed[0]:
            raise _Expired

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except _Expired:
        raise UserError(
            f"{what} did not return within {seconds:g} s (--timeout; vramplan gives user code "
            "a time limit): check it for a loop or a wait, or raise --timeout"
        ) from None
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
