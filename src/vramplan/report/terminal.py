"""The terminal view of an Estimate, drawn with rich::

render_estimate(est, "binary")   # peak lines, bar, breakdown table, notes
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from vramplan.report.bars import component_bar
from vramplan.report.palette import COLOURS
from vramplan.result import COMPONENTS, Component, Estimate
from vramplan.units import Units, format_bytes, unit_name

_LABELS = {
    Component.PARAMETERS: "parameters",
    Component.BUFFERS: "buffers",
    Component.GRADIENTS: "gradients",
    Component.OPTIMIZER_STATE: "optimizer state",
    Component.ACTIVATIONS: "activations (saved for backward)",
    Component.TEMPORARIES: "temporaries / workspace",
    Component.INPUTS: "input batch",
    Component.KV_CACHE: "KV cache",
    "workspace": "workspace",
}


def group_repeated(usages) -> list[tuple[str, str, int, int, int]]:
    """Rows for the top-modules table with repeated blocks folded into one: the first
    numbered part of a name becomes ``*`` (``transformer.h.3.attn`` → ``transformer.h.*.attn``)
    and modules of one kind under one pattern share a row. Each row is (name, kind, count,
    total bytes, largest bytes), largest total first.

    >>> from vramplan.result import ModuleUsage
    >>> group_repeated([ModuleUsage(f"h.{i}", "Block", 8) for i in range(12)])
    [('h.*', 'Block', 12, 96, 8)]
    """
    groups: dict[tuple[str, str], list[int]] = {}
    for usage in usages:
        parts = usage.name.split(".")
        index = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        pattern = (
            usage.name if index is None else ".".join(parts[:index] + ["*"] + parts[index + 1 :])
        )
        groups.setdefault((pattern, usage.kind), []).append(usage.activation_bytes)
    rows = []
    for (pattern, kind), sizes in groups.items():
        if len(sizes) == 1:
            name = next(u.name for u in usages if u.kind == kind and _matches(u.name, pattern))
            rows.append((name, kind, 1, sizes[0], sizes[0]))
        else:
            rows.append((pattern, kind, len(sizes), sum(sizes), max(sizes)))
    return sorted(rows, key=lambda row: -row[3])


def _matches(name: str, pattern: str) -> bool:
    a, b = name.split("."), pattern.split(".")
    return len(a) == len(b) and all(x == y or y == "*" for x, y in zip(a, b, strict=True))


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:5.1f}%" if whole else "  -  "


def _recipe_line(est: Estimate) -> str:
    r = est.recipe
    parts = [f"batch {r.batch_size}"]
    if r.seq_len:
        parts.append(f"seq {r.seq_len}")
    if r.input_shape:
        parts.append("input " + "x".join(map(str, r.input_shape)))
    if r.mode == "generate":
        return ", ".join([*parts, r.precision, _generation_line(est)])
    parts += [r.precision, f"optimizer {r.optimizer}", f"checkpointing {r.checkpointing}", r.mode]
    if r.grad_accum > 1:
        parts.append(f"grad-accum {r.grad_accum}")
    return ", ".join(parts)


def _generation_line(est: Estimate) -> str:
    g = est.details.get("generation", {})
    beams = f" × {est.recipe.num_beams} beams" if est.recipe.num_beams > 1 else ""
    if "cross_cache_bytes" in g:
        return f"generate (encoder-decoder) {g.get('new_tokens')} new tokens, dynamic cache"
    return (
        f"generate {g.get('prompt_tokens')} + {g.get('new_tokens')} new tokens{beams}, "
        f"{g.get('cache')} cache"
    )


def generation_lines(est: Estimate, fmt) -> list[str]:
    """The prefill and decode peaks and the KV cache of a ``--mode generate`` estimate."""
    g = est.details.get("generation")
    if not g:
        return []
    peaks = (
        f"Prefill peak {fmt(g['prefill_peak_bytes'])}, last decode step peak "
        f"{fmt(g['decode_peak_bytes'])} (tensor bytes)"
    )
    if "cross_cache_bytes" in g:
        return [
            peaks,
            f"KV cache: {fmt(g['kv_cache_bytes'])} for {g['sequences']} sequences: "
            f"cross-attention {fmt(g['cross_cache_bytes'])} (encoder length), "
            f"self-attention {fmt(g['self_cache_bytes'])} ({g['self_cache_tokens']} tokens)",
        ]
    return [
        peaks,
        f"KV cache: {fmt(g['kv_cache_bytes'])} for {g['sequences']} × {g['kv_cache_tokens']} "
        f"tokens ({g['kv_bytes_per_token']:,} bytes per token per sequence)",
    ]


def render_estimate(est: Estimate, units: Units = "binary", console: Console | None = None) -> None:
    """Print the peak, its breakdown, the five-part summary and the top modules."""
    console = console or Console()
    fmt = lambda n: format_bytes(n, units)  # noqa: E731
    peak = est.peak
    about = ", ".join(
        filter(None, [est.model.architecture, f"{est.model.parameters:,} parameters"])
    )
    console.print(f"[bold]{est.model.name}[/bold] ({about}) — {_recipe_line(est)}")
    when = f" in {peak.phase}, iteration {peak.iteration}" if est.method == "trace" else ""
    if est.recipe.mode == "generate" and est.method == "trace":
        when = " in the prefill" if peak.iteration == 1 else " in the last decode step"
    label = "Peak allocated" if est.method == "trace" else f"Total ({est.method})"
    console.print(
        f"{label}: [bold]{fmt(peak.allocated_bytes)}[/bold] ({peak.allocated_bytes:,} bytes){when}"
    )
    # under --framework tensorflow these two are PyTorch's runtime; TensorFlow's are in notes
    pytorch = "PyTorch's " if "tensorflow" in est.details else ""
    if peak.reserved_bytes is not None:
        span = peak.reserved_range_bytes
        extra = f" (range {fmt(span[0])} – {fmt(span[1])})" if span else ""
        console.print(
            f"Peak reserved ({pytorch}caching allocator): {fmt(peak.reserved_bytes)}{extra}"
        )
    if peak.device_total_bytes is not None:
        counter = est.details.get("used_counter")
        shows = f"{counter} 'used'" if counter else "what nvidia-smi shows"
        if pytorch:
            shows += " under PyTorch; TensorFlow's figures are in the notes"
        span = peak.device_total_range_bytes
        extra = ""
        if span:
            widest = est.details.get("range", {}).get("widest")
            extra = f" (range {fmt(span[0])} – {fmt(span[1])}" + (
                f"; widest unknown: {widest})" if widest else ")"
            )
        console.print(f"Device total ({shows}): {fmt(peak.device_total_bytes)}{extra}")

    console.print(component_bar(est.components))
    table = Table(title="Breakdown at the peak", title_justify="left")
    table.add_column("component")
    table.add_column("", width=2)
    table.add_column("bytes", justify="right")
    table.add_column("size", justify="right")
    table.add_column("share", justify="right")
    for name in COMPONENTS:
        value = est.components.get(name, 0)
        table.add_row(
            _LABELS[name],
            Text("██", style=COLOURS[name]),
            f"{value:,}",
            fmt(value),
            _share(value, peak.allocated_bytes),
        )
    console.print(table)

    summary = est.summary
    console.print(
        "Five-part summary: "
        + ", ".join(f"{_LABELS.get(k, k).split(' (')[0]} {fmt(v)}" for k, v in summary.items())
    )
    for line in generation_lines(est, fmt):
        console.print(line)
    if est.phase_peaks and est.recipe.mode != "generate":
        console.print(
            "Peak by phase: "
            + ", ".join(f"{phase} {fmt(v)}" for phase, v in est.phase_peaks.items())
        )
    if est.top_modules:
        modules = Table(title="Top modules by activation bytes at the peak", title_justify="left")
        modules.add_column("module")
        modules.add_column("type")
        modules.add_column("activations", justify="right")
        for name, kind, count, total, largest in group_repeated(est.top_modules):
            if count == 1:
                modules.add_row(name, kind, fmt(total))
            else:
                each = f"{fmt(largest)} each" if largest * count == total else f"{fmt(total)}"
                modules.add_row(f"{name} ×{count}", kind, each)
        console.print(modules)
    if est.verdict is not None:
        v = est.verdict
        colour = {"fits": "green", "tight": "yellow", "oom": "red"}[v.status]
        spare = (
            f"{fmt(v.spare_bytes)} to spare"
            if v.spare_bytes >= 0
            else f"{fmt(-v.spare_bytes)} missing"
        )
        console.print(
            f"Verdict on {v.gpu} ({fmt(v.capacity_bytes)}, headroom {v.headroom:.0%}): "
            f"[bold {colour}]{v.status.upper()}[/bold {colour}] — {spare}"
        )
    for note in est.notes:
        console.print(f"[dim]note: {note}[/dim]")
    console.print(f"[dim]Sizes in {unit_name(units)}.[/dim]")
