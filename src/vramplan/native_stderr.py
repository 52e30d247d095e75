"""Silence what native libraries write straight to file descriptor 2 (the profiler's
start/stop lines, PyTorch's C++ ``TORCH_WARN_ONCE``), which Python cannot catch::

    with quiet_native_stderr():
        noisy_native_call()
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_native_stderr() -> Iterator[None]:
    """File descriptor 2 goes to /dev/null for the duration (Python-level errors still
    reach the callers, which catch them)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
