"""Write the optional report files a command was asked for (``--html``, ``--plot``).

write_reports(estimate, html="report.html", plot=None, units="binary")
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from vramplan.errors import UserError
from vramplan.report.html import BatchCurve, CurvePoint, render_html
from vramplan.result import Estimate


def curve_sizes(batch: int) -> list[int]:
    """The batch sizes of the HTML report's curve: half, once and twice ``batch``."""
    return sorted({max(1, batch // 2), batch, 2 * batch})


def batch_curve_for(estimate: Estimate, estimate_at) -> BatchCurve:
    """Estimates at half, once and twice the batch (``estimate_at(batch)`` traces one)."""
    batch = estimate.recipe.batch_size
    sizes = curve_sizes(batch)
    points = []
    for size in sizes:
        at = estimate if size == batch else estimate_at(size)
        points.append(
            CurvePoint(
                size, at.peak.allocated_bytes, at.peak.device_total_bytes or at.peak.allocated_bytes
            )
        )
    capacities = {estimate.verdict.gpu: estimate.verdict.usable_bytes} if estimate.verdict else {}
    return BatchCurve(tuple(points), capacities)


_INPUT_SUFFIXES = (".py", ".json", ".yaml", ".yml", ".toml", ".pt", ".pth", ".safetensors")


def check_report_paths(html: str | None = None, plot: str | None = None) -> None:
    """Refuse, before any tracing, a report path that cannot be written or that looks like
    one of the user's inputs (a report never replaces a model file or a config)."""
    for flag, path in (("--html", html), ("--plot", plot)):
        if path is None:
            continue
        target = Path(path).expanduser()
        if not str(path).strip() or target.is_dir():
            raise UserError(f"{flag} needs a file path, got {path!r}")
        if target.suffix.lower() in _INPUT_SUFFIXES:
            raise UserError(
                f"{flag} {path}: a report never replaces a {target.suffix} file; "
                f"give a .{'html' if flag == '--html' else 'png'} path"
            )
        parent = target.parent
        if not parent.is_dir():
            raise UserError(f"cannot write {path}: folder {parent} does not exist")
        if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
            raise UserError(f"cannot write {path}: permission denied")


def write_reports(
    estimate: Estimate,
    *,
    html: str | None,
    plot: str | None,
    units: str,
    batch_curve: BatchCurve | None = None,
    plan: list[list[str]] | None = None,
    measurement: list[list[str]] | None = None,
) -> None:
    """Write the HTML report and/or the PNG; never touch anything else."""
    if html:
        command = shlex.join(["vramplan", *sys.argv[1:]])
        text = render_html(
            estimate,
            units=units,
            batch_curve=batch_curve,
            plan=plan,
            measurement=measurement,
            command=command,
        )
        try:
            Path(html).write_text(text, encoding="utf-8")
        except OSError as exc:
            raise UserError(f"cannot write {html}: {exc.strerror}") from None
        print(f"wrote {html}", file=sys.stderr)
    if plot:
        from vramplan.report.plot import write_plot

        write_plot(estimate, plot, units)
        print(f"wrote {plot}", file=sys.stderr)
