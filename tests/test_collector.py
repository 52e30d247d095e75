"""The cyclic garbage collector: off while the command line imports, on (what was alive
frozen out of its passes) from the first recorded storage, as it was after the command."""

from __future__ import annotations

import gc
import weakref

from vramplan.cli import main
from vramplan.collector import paused, resume, settle
from vramplan.trace.recorder import AllocationRecorder


def test_off_until_the_first_recorder():
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with paused():
        assert not gc.isenabled()
        AllocationRecorder()
        assert gc.isenabled() and gc.get_freeze_count() > 0
        resume()  # a second recorder changes nothing
        assert gc.isenabled()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_as_it_was_after_a_command(capsys):
    assert main(["calc", "--params", "20M", "--activations-per-sample", "1M", "-b", "8"]) == 0
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()
    try:
        with paused():
            resume()
            assert not gc.isenabled()  # not paused by it: left alone
    finally:
        gc.enable()


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_settle_frees_cycles_and_freezes_the_living_once_resumed():
    settle()  # outside the command line's pause: nothing
    assert gc.get_freeze_count() == 0
    with paused():
        resume()
        frozen = gc.get_freeze_count()
        kept, dropped = _Node(), _Node()
        gone = weakref.ref(dropped)
        del dropped
        settle()
        assert gone() is None  # the garbage collected first...
        assert gc.get_freeze_count() > frozen  # ...what lives frozen, out of the passes
        assert not any(obj is kept for obj in gc.get_objects())
    assert gc.isenabled() and gc.get_freeze_count() == 0
