"""One self-contained HTML report of an Estimate: inline CSS and server-side SVG, no
JavaScript (the Estimate's JSON is embedded as data), no network. Every number shown is
read from the same Estimate the JSON prints.

    >>> from vramplan.analytic.calc import calculate
    >>> from vramplan.recipe import Recipe
    >>> page = render_html(calculate(20_000_000, 32, 1_000_000, Recipe(optimizer="adam")))
    >>> page.startswith("<!DOCTYPE html>"), '<script type="application/json"' in page
    (True, True)
    >>> page.count("<script"), "http" in page.replace("http-equiv", "")
    (1, False)
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field

from vramplan.report.palette import COLOURS, LABELS
from vramplan.result import COMPONENTS, Component, Estimate, Phase
from vramplan.units import Units, format_bytes

WIDTH = 1100
PHASE_SHADES = {
    Phase.SETUP: "#f4f4f4",
    Phase.FORWARD: "#e8f1fa",
    Phase.BACKWARD: "#fbeee6",
    Phase.OPTIMIZER: "#eef7f1",
}


@dataclass(frozen=True)
class CurvePoint:
    """Predicted memory at one batch size."""

    batch_size: int
    allocated_bytes: int
    device_total_bytes: int


@dataclass(frozen=True)
class BatchCurve:
    """Predicted peak against batch size, the cards to draw, and the largest batch found."""

    points: tuple[CurvePoint, ...]
    capacities: dict[str, int] = field(default_factory=dict)
    """Usable bytes (after headroom) of each card to draw as a line."""
    max_batch: int | None = None


def _e(text) -> str:
    return html.escape(str(text))


def _ticks(top: int, count: int = 5) -> list[int]:
    step = max(1, top // count)
    magnitude = 1
    while magnitude * 10 <= step:
        magnitude *= 10
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= step)
    return list(range(0, top + step, step))


def _peak_bar(est: Estimate, units: Units) -> str:
    """Horizontal stacked bar of the components, with reserved, device total, capacity."""
    peak = est.peak
    figures = [
        ("allocated", peak.allocated_bytes),
        ("reserved", peak.reserved_bytes),
        ("device total", peak.device_total_bytes),
    ]
    if peak.device_total_range_bytes is not None:
        figures.append(("high end", peak.device_total_range_bytes[1]))
    marks = [(name, value) for name, value in figures[1:] if value]
    if est.verdict is not None:
        marks += [
            ("capacity", est.verdict.capacity_bytes),
            (f"usable ({est.verdict.headroom:.0%} headroom)", est.verdict.usable_bytes),
        ]
    top = max([peak.allocated_bytes, *(v for _, v in marks)]) or 1
    left, bar_w, y, h = 150, WIDTH - 190, 30, 46
    scale = bar_w / top
    parts, x = [], left
    for name in COMPONENTS:
        value = est.components.get(name, 0)
        if value <= 0:
            continue
        w = value * scale
        parts.append(
            f'<rect class="segment" data-component="{name}" data-bytes="{value}" '
            f'x="{x:.1f}" y="{y}" width="{w:.1f}" height="{h}" '
            f'fill="{COLOURS[name]}"><title>{LABELS[name]}: {_e(format_bytes(value, units))}'
            f"</title></rect>"
        )
        x += w
    parts.append(f'<text x="{left - 8}" y="{y + h / 2 + 4}" text-anchor="end">allocated</text>')
    for i, (name, value) in enumerate(marks):
        mx = left + value * scale
        dash = ' stroke-dasharray="6 4"' if name.startswith("usable") else ""
        parts.append(
            f'<line class="mark" data-mark="{_e(name)}" data-bytes="{value}" x1="{mx:.1f}"'
            f' x2="{mx:.1f}" y1="{y - 12}" y2="{y + h + 12}" stroke="#222"'
            f' stroke-width="2"{dash}/>'
        )
        anchor = "end" if mx > left + 0.75 * bar_w else "start" if mx < left + 80 else "middle"
        parts.append(
            f'<text x="{mx:.1f}" y="{y + h + 28 + 14 * i}" text-anchor="{anchor}">'
            f"{_e(name)} {_e(format_bytes(value, units))}</text>"
        )
    for tick in _ticks(top):
        tx = left + tick * scale
        if tx <= left + bar_w + 1:
            parts.append(
                f'<text class="tick" x="{tx:.1f}" y="{y - 16}" text-anchor="middle">'
                f"{_e(format_bytes(tick, units, 0))}</text>"
            )
    height = y + h + 40 + 14 * len(marks)
    return (
        f'<svg id="peak-bar" role="img" aria-label="components at the peak" '
        f'viewBox="0 0 {WIDTH} {height}" width="100%">{"".join(parts)}</svg>'
    )


def _legend() -> str:
    items = "".join(
        f'<span class="key"><i style="background:{COLOURS[n]}"></i>{LABELS[n]}</span>'
        for n in COMPONENTS
    )
    return f'<div class="legend">{items}</div>'


def _timeline(est: Estimate, units: Units) -> str:
    """Stacked areas of live bytes per component over the traced events, phases shaded."""
    points = est.timeline
    if not points:
        return "<p>No timeline (this estimate was not traced).</p>"
    left, right, top_y, plot_h = 90, 20, 20, 300
    plot_w = WIDTH - left - right
    last = points[-1].index or 1
    top = max(p.total for p in points) or 1
    sx = lambda i: left + i / last * plot_w  # noqa: E731
    sy = lambda v: top_y + plot_h - v / top * plot_h  # noqa: E731
    parts = []
    start = points[0]
    for point in [*points[1:], None]:
        if point is None or point.phase != start.phase or point.iteration != start.iteration:
            end = point.index if point is not None else last
            parts.append(
                f'<rect class="phase" data-phase="{start.phase}" x="{sx(start.index):.1f}"'
                f' y="{top_y}" width="{max(0.5, sx(end) - sx(start.index)):.1f}"'
                f' height="{plot_h}" fill="{PHASE_SHADES.get(start.phase, "#fff")}"/>'
            )
            label_x = (sx(start.index) + sx(end)) / 2
            if sx(end) - sx(start.index) > 60:
                parts.append(
                    f'<text x="{label_x:.1f}" y="{top_y + 14}" text-anchor="middle" '
                    f'class="phase-label">{start.phase} {start.iteration}</text>'
                )
            start = point
    below = [0] * len(points)
    for name in COMPONENTS:
        if not any(p.components.get(name, 0) for p in points):
            continue
        upper = [b + p.components.get(name, 0) for b, p in zip(below, points, strict=True)]
        path = " ".join(
            f"{sx(p.index):.1f},{sy(u):.1f}" for p, u in zip(points, upper, strict=True)
        )
        back = " ".join(
            f"{sx(p.index):.1f},{sy(b):.1f}"
            for p, b in reversed(list(zip(points, below, strict=True)))
        )
        parts.append(
            f'<polygon class="area" data-component="{name}" points="{path} {back}" '
            f'fill="{COLOURS[name]}" fill-opacity="0.85"><title>{LABELS[name]}</title>'
            f"</polygon>"
        )
        below = upper
    peak_point = max(points, key=lambda p: p.total)
    px, py = sx(peak_point.index), sy(peak_point.total)
    parts.append(
        f'<circle id="peak-marker" cx="{px:.1f}" cy="{py:.1f}" r="5" fill="#000"/>'
        f'<text x="{min(px + 8, WIDTH - 200):.1f}" y="{py + 4:.1f}">peak '
        f"{_e(format_bytes(peak_point.total, units))} ({peak_point.phase})</text>"
    )
    for tick in _ticks(top):
        if tick <= top:
            parts.append(
                f'<line x1="{left}" x2="{left + plot_w}" y1="{sy(tick):.1f}" '
                f'y2="{sy(tick):.1f}" stroke="#ccc" stroke-width="0.5"/>'
                f'<text class="tick" x="{left - 6}" y="{sy(tick) + 4:.1f}" '
                f'text-anchor="end">{_e(format_bytes(tick, units, 0))}</text>'
            )
    parts.append(
        f'<text x="{left + plot_w / 2}" y="{top_y + plot_h + 30}" text-anchor="middle">'
        "traced allocation events (time order)</text>"
        f'<text transform="translate(16 {top_y + plot_h / 2}) rotate(-90)" '
        'text-anchor="middle">live tensor memory</text>'
    )
    return (
        f'<svg id="timeline" role="img" aria-label="memory timeline" '
        f'viewBox="0 0 {WIDTH} {top_y + plot_h + 40}" width="100%">{"".join(parts)}</svg>'
    )


def _batch_curve(curve: BatchCurve | None, units: Units) -> str:
    if curve is None or not curve.points:
        return "<p>No batch curve for this report.</p>"
    left, right, top_y, plot_h = 90, 140, 20, 260
    plot_w = WIDTH - left - right
    max_b = max(p.batch_size for p in curve.points)
    top = max([p.device_total_bytes for p in curve.points] + list(curve.capacities.values())) or 1
    sx = lambda b: left + b / max_b * plot_w  # noqa: E731
    sy = lambda v: top_y + plot_h - v / top * plot_h  # noqa: E731
    parts = []
    for key, colour in (
        ("allocated_bytes", COLOURS[Component.ACTIVATIONS]),
        ("device_total_bytes", COLOURS[Component.PARAMETERS]),
    ):
        coords = " ".join(f"{sx(p.batch_size):.1f},{sy(getattr(p, key)):.1f}" for p in curve.points)
        parts.append(
            f'<polyline class="curve" data-series="{key}" points="{coords}" fill="none" '
            f'stroke="{colour}" stroke-width="2.5"/>'
        )
        for p in curve.points:
            parts.append(
                f'<circle class="curve-point" data-batch="{p.batch_size}" '
                f'data-bytes="{getattr(p, key)}" cx="{sx(p.batch_size):.1f}" '
                f'cy="{sy(getattr(p, key)):.1f}" r="3.5" fill="{colour}"/>'
            )
    parts.append(
        f'<text x="{left + plot_w + 8}" y="{sy(curve.points[-1].device_total_bytes):.1f}"'
        ">device total</text>"
        f'<text x="{left + plot_w + 8}" y="{sy(curve.points[-1].allocated_bytes) + 14:.1f}"'
        ">allocated</text>"
    )
    for name, usable in curve.capacities.items():
        parts.append(
            f'<line class="gpu-line" data-gpu="{_e(name)}" x1="{left}" '
            f'x2="{left + plot_w}" y1="{sy(usable):.1f}" y2="{sy(usable):.1f}" '
            'stroke="#222" stroke-dasharray="6 4"/><text x="'
            f'{left + plot_w + 8}" y="{sy(usable) + 4:.1f}">{_e(name)} usable</text>'
        )
    if curve.max_batch:
        mx = sx(curve.max_batch)
        parts.append(
            f'<line id="max-batch" x1="{mx:.1f}" x2="{mx:.1f}" y1="{top_y}" '
            f'y2="{top_y + plot_h}" stroke="#009E73" stroke-width="2"/>'
            f'<text x="{mx + 4:.1f}" y="{top_y + 12}">max batch {curve.max_batch}</text>'
        )
    for tick in _ticks(top):
        if tick <= top:
            parts.append(
                f'<text class="tick" x="{left - 6}" y="{sy(tick) + 4:.1f}" '
                f'text-anchor="end">{_e(format_bytes(tick, units, 0))}</text>'
            )
    for p in curve.points:
        parts.append(
            f'<text class="tick" x="{sx(p.batch_size):.1f}" y="{top_y + plot_h + 16}" '
            f'text-anchor="middle">{p.batch_size}</text>'
        )
    parts.append(
        f'<text x="{left + plot_w / 2}" y="{top_y + plot_h + 36}" text-anchor="middle">'
        'batch size</text><text transform="translate(16 '
        f'{top_y + plot_h / 2}) rotate(-90)" text-anchor="middle">predicted peak</text>'
    )
    return (
        f'<svg id="batch-curve" role="img" aria-label="peak against batch size" '
        f'viewBox="0 0 {WIDTH} {top_y + plot_h + 46}" width="100%">{"".join(parts)}</svg>'
    )


def _table(rows: list[list[str]], header: list[str], table_id: str) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _summary_rows(est: Estimate, units: Units) -> list[list[str]]:
    rows = [
        [
            "peak allocated",
            format_bytes(est.peak.allocated_bytes, units),
            f"{est.peak.allocated_bytes:,}",
        ]
    ]
    for label, value in (
        ("peak reserved", est.peak.reserved_bytes),
        ("device total", est.peak.device_total_bytes),
    ):
        if value is not None:
            rows.append([label, format_bytes(value, units), f"{value:,}"])
    for label, pair in (
        ("reserved range", est.peak.reserved_range_bytes),
        ("device total range", est.peak.device_total_range_bytes),
    ):
        if pair is not None:
            rows.append(
                [
                    label,
                    f"{format_bytes(pair[0], units)} – {format_bytes(pair[1], units)}",
                    f"{pair[0]:,} – {pair[1]:,}",
                ]
            )
    rows += [
        [LABELS[n], format_bytes(est.components[n], units), f"{est.components[n]:,}"]
        for n in COMPONENTS
    ]
    return rows


STYLE = """
body{font:15px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;
max-width:1180px;padding:0 16px;color:#1a1a1a}
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;margin:28px 0 8px}
svg text{font-size:13px;fill:#1a1a1a}svg .tick{font-size:11px;fill:#555}
.phase-label{font-size:12px;fill:#444}
.legend{display:flex;flex-wrap:wrap;gap:14px;margin:6px 0 10px}
.key i{display:inline-block;width:14px;height:14px;margin-right:6px;vertical-align:-2px;
border:1px solid #333}
table{border-collapse:collapse;margin:6px 0}td,th{border:1px solid #ccc;padding:4px 10px;
text-align:right}td:first-child,th:first-child{text-align:left}
.badge{display:inline-block;padding:2px 10px;border-radius:4px;font-weight:600;color:#fff}
.fits{background:#00734d}.tight{background:#8a5a00}.oom{background:#a02c00}
pre{background:#f6f6f6;padding:10px;overflow-x:auto;font-size:12px}
"""


def render_html(
    est: Estimate,
    *,
    units: Units = "binary",
    batch_curve: BatchCurve | None = None,
    plan: list[list[str]] | None = None,
    measurement: list[list[str]] | None = None,
    command: str = "",
) -> str:
    """The whole report as one HTML string."""
    verdict = ""
    if est.verdict is not None:
        v = est.verdict
        spare = (
            f"{format_bytes(v.spare_bytes, units)} to spare"
            if v.spare_bytes >= 0
            else f"{format_bytes(-v.spare_bytes, units)} missing"
        )
        verdict = (
            f'<p id="verdict">On {_e(v.gpu)} ({_e(format_bytes(v.capacity_bytes, units))},'
            f' {v.headroom:.0%} headroom): <span class="badge {v.status}">'
            f"{v.status.upper()}</span> — {_e(spare)}</p>"
        )
    modules = _table(
        [[m.name, m.kind, format_bytes(m.activation_bytes, units)] for m in est.top_modules],
        ["module", "type", "activations"],
        "modules",
    )
    sections = [
        f"<h1>{_e(est.model.name)}</h1><p>{_e(est.model.architecture)}, "
        f"{est.model.parameters:,} parameters — peak in {_e(est.peak.phase)}</p>{verdict}",
        "<h2>Breakdown at the peak</h2>",
        _legend(),
        _peak_bar(est, units),
        _table(_summary_rows(est, units), ["figure", "size", "bytes"], "summary"),
        "<h2>Memory over the traced iterations</h2>",
        _timeline(est, units),
        "<h2>Top modules by activation bytes at the peak</h2>",
        modules,
        "<h2>Peak against batch size</h2>",
        _batch_curve(batch_curve, units),
    ]
    if plan:
        sections += ["<h2>Plan</h2>", _table(plan[1:], plan[0], "plan")]
    if measurement:
        sections += [
            "<h2>Estimate vs measurement</h2>",
            _table(measurement[1:], measurement[0], "measurement"),
        ]
    notes = "".join(f"<li>{_e(n)}</li>" for n in est.notes)
    data = est.to_json(timeline=False)
    inputs = {"command": command, "recipe": data["recipe"], "versions": data["versions"]}
    embedded = json.dumps(data).replace("</", "<\\/")
    sections += [
        f"<h2>Notes</h2><ul>{notes}</ul>",
        "<h2>Inputs (to reproduce)</h2>",
        f'<pre id="inputs">{_e(json.dumps(inputs, indent=2))}</pre>',
        f'<script type="application/json" id="estimate-json">{embedded}</script>',
        f"<p>Sizes in {'MiB/GiB (2^20/2^30 bytes)' if units == 'binary' else 'MB/GB'}.</p>",
    ]
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>vramplan — {_e(est.model.name)}</title><style>{STYLE}</style></head>"
        f"<body>{''.join(sections)}</body></html>"
    )
