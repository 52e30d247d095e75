"""The progress line on stderr while traces run: what is being traced, which trace of how
many, and for how long. A ``Session`` calls it with a ``TraceEvent`` as each trace starts
and ends::

    with trace_progress(progress_wanted(json_output, quiet)) as progress:
        vramplan.Session(model, gpu="a100", progress=progress).plan(batch_size=8)

Nothing is printed under ``--json`` or ``--quiet``, or when stderr is not a terminal
(``trace_progress(False)`` gives ``None``: no callback at all).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from vramplan.planner.bench import TraceEvent


def progress_wanted(json_output: bool, quiet: bool, stream: IO[str] | None = None) -> bool:
    """A progress line only for a person at a terminal: not with --json or --quiet, and not
    when stderr goes to a file or a pipe."""
    if json_output or quiet:
        return False
    isatty = getattr(stream or sys.stderr, "isatty", None)
    return bool(isatty and isatty())


class TraceProgress:
    """A progress callback: one transient rich line on ``stream`` for the running trace
    (``⠋ trace 2 of 3: hf:gpt2: batch 8, seq 512, fp32, adamw 0:00:04``), and a
    tally of the traces it saw."""

    def __init__(self, stream: IO[str] | None = None, expected: int | None = None) -> None:
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        console = Console(file=stream or sys.stderr)
        self.expected = expected
        self.started = 0
        self.finished = 0
        self.seconds = 0.0
        self._line = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        self._task = self._line.add_task("preparing", total=None)

    def __call__(self, event: TraceEvent) -> None:
        if event.done:
            self.finished += 1
            self.seconds += event.seconds
            return
        self.started += 1
        of = f" of {self.expected}" if self.expected and event.index <= self.expected else ""
        self._line.reset(self._task, description=f"trace {event.index}{of}: {event.label}")

    def start(self) -> None:
        self._line.start()

    def stop(self) -> None:
        self._line.stop()


@contextmanager
def trace_progress(
    enabled: bool, *, expected: int | None = None, stream: IO[str] | None = None
) -> Iterator[TraceProgress | None]:
    """A ``TraceProgress`` shown on ``stream`` (stderr) while the block runs, or ``None``
    when not ``enabled``; the line is cleared when the block ends."""
    if not enabled:
        yield None
        return
    progress = TraceProgress(stream, expected)
    progress.start()
    try:
        yield progress
    finally:
        progress.stop()
