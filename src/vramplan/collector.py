"""The cyclic garbage collector, off while a command imports its libraries.

Importing torch, ``torch._dynamo`` and transformers creates about half a million objects,
and the collector's passes over them cost about a seventh of those imports' CPU time; none
of it is garbage. So the command line runs with the collector off (``paused``) until the
first storage is recorded or measured (``resume``): from there on it runs as usual, with
what is alive then frozen out of its passes (``gc.freeze``). A storage caught in a
reference cycle is freed when the collector runs, in a trace as on the GPU, so the
collector is on wherever storages are recorded::

    with paused():          # vramplan's main()
        import torch        # no collection
        resume()            # AllocationRecorder(), measure_built()
        ...                 # collections as usual
        settle()            # a planner's trace cached: frozen out of later passes
        with quiet():       # an allocator replay: no storages, no collections
            ...
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

_paused = False
_frozen = False


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The collector off until ``resume`` (or the end); afterwards as it was."""
    global _paused, _frozen
    if not gc.isenabled():
        yield
        return
    gc.disable()
    _paused = True
    try:
        yield
    finally:
        if _frozen:
            gc.unfreeze()
        _paused = _frozen = False
        gc.enable()


def resume() -> None:
    """The collector back on, what is alive now left out of its passes (within
    ``paused``; else nothing)."""
    global _paused, _frozen
    if _paused:
        gc.freeze()
        _paused, _frozen = False, True
        gc.enable()


def settle() -> None:
    """Within ``paused`` once resumed (else nothing): collect what is garbage now, and
    leave what is alive out of later passes. A planner keeps every trace it ran (a
    million objects after a few dozen), and the full passes that its later traces and
    replays set off would walk them all again: the Llama-3-8B plan (25 traces) spent 12.6
    of its 95 seconds there. Reference counting still frees them (``gc.freeze`` stops only the
    cycle search), and ``paused`` unfreezes at its end."""
    if _frozen:
        gc.collect()
        gc.freeze()


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """No collections inside; as it was afterwards. For the pure-Python work between traces
    (summaries, allocator replays, rebuilding repeated blocks): it records no storage, so
    when its garbage is collected changes no figure, and the millions of short-lived
    objects it makes would otherwise set off passes over everything alive.

    >>> with quiet():
    ...     gc.isenabled()
    False
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
