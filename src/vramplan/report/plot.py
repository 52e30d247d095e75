"""``--plot file.png``: the breakdown and the timeline as an image (matplotlib, optional)::

write_plot(estimate, "memory.png")
"""

from __future__ import annotations

from vramplan.errors import UserError
from vramplan.report.palette import COLOURS, LABELS
from vramplan.result import COMPONENTS, Estimate
from vramplan.units import Units, format_bytes


def write_plot(est: Estimate, path: str, units: Units = "binary") -> None:
    """Save a two-panel PNG: components at the peak, and live memory over the trace."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'vramplan[plot]'") from None
    scale, unit = (2**30, "GiB") if units == "binary" else (1e9, "GB")
    figure, (bar, timeline) = plt.subplots(2, 1, figsize=(11, 7), height_ratios=(1, 2.2))
    left = 0.0
    for name in COMPONENTS:
        value = est.components.get(name, 0) / scale
        if value:
            bar.barh(
                0,
                value,
                left=left,
                color=COLOURS[name],
                label=LABELS[name],
                edgecolor="black",
                linewidth=0.4,
            )
            left += value
    for label, value in (
        ("reserved", est.peak.reserved_bytes),
        ("device total", est.peak.device_total_bytes),
    ):
        if value:
            bar.axvline(value / scale, color="black", linestyle="-")
            bar.text(value / scale, 0.45, f" {label}", va="bottom")
    if est.verdict is not None:
        bar.axvline(est.verdict.usable_bytes / scale, color="black", linestyle="--")
        bar.text(est.verdict.usable_bytes / scale, -0.5, f" usable on {est.verdict.gpu}")
    bar.set_yticks([])
    bar.set_xlabel(f"memory at the peak ({unit})")
    bar.set_title(
        f"{est.model.name}: peak allocated "
        f"{format_bytes(est.peak.allocated_bytes, units)} in {est.peak.phase}"
    )
    bar.legend(ncol=4, fontsize=8, loc="upper left", bbox_to_anchor=(0, -0.45))
    if est.timeline:
        xs = [p.index for p in est.timeline]
        stacks = [[p.components.get(n, 0) / scale for p in est.timeline] for n in COMPONENTS]
        timeline.stackplot(
            xs,
            stacks,
            colors=[COLOURS[n] for n in COMPONENTS],
            labels=[LABELS[n] for n in COMPONENTS],
        )
        timeline.set_xlabel("traced allocation events (time order)")
        timeline.set_ylabel(f"live tensor memory ({unit})")
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=110)
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror}") from None
    finally:
        plt.close(figure)
