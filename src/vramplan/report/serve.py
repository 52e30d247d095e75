"""A serving plan (``vramplan serve``) as terminal lines or JSON::

render_serving(vramplan.serve("hf:meta-llama-3-8b", gpu="h100"), "binary")
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from vramplan.units import Units, format_bytes

if TYPE_CHECKING:
    from vramplan.planner.serving import ServingPlan


def render_serving(plan: ServingPlan, units: Units = "binary") -> None:
    """The engine's reservation on one rank, and what its KV cache holds."""
    console = Console()
    fmt = lambda n: format_bytes(n, units)  # noqa: E731
    o = plan.options
    console.print(
        f"[bold]{plan.model}[/bold] served by {o.engine} on {plan.gpu}"
        + (f" (tensor parallel {o.tp}, per rank)" if o.tp > 1 else "")
        + f" — {o.dtype}, gpu_memory_utilization {o.gpu_memory_utilization}, "
        f"max_model_len {plan.max_model_len}, max_num_seqs {o.max_num_seqs}, "
        f"max_num_batched_tokens {o.max_num_batched_tokens}"
    )
    table = Table(title="Start-up accounting", title_justify="left")
    table.add_column("part")
    table.add_column("size", justify="right")
    table.add_column("bytes", justify="right")
    rows = (
        ("card total (torch.cuda.mem_get_info)", plan.total_bytes),
        (f"× {o.gpu_memory_utilization} utilization", plan.requested_bytes),
        ("− weights", plan.weights_bytes),
        ("− profile-run peak (activations, sampler)", plan.activation_peak_bytes),
        ("− memory outside PyTorch", plan.non_torch_bytes),
        ("= KV cache", plan.kv_cache_bytes),
    )
    for label, value in rows:
        table.add_row(label, fmt(value), f"{value:,}")
    console.print(table)
    dtype = o.kv_cache_dtype if o.kv_cache_dtype != "auto" else o.dtype
    console.print(
        f"KV cache: {plan.kv_tokens:,} tokens ({plan.kv_bytes_per_token:,} bytes per token "
        f"in {dtype}, blocks of {o.block_size}); {plan.max_concurrency:.2f}× concurrency at "
        f"{plan.max_model_len:,} tokens per sequence"
    )
    colour = "green" if plan.fits else "red"
    verdict = "STARTS" if plan.fits else "DOES NOT START (one sequence does not fit)"
    capped = " (the model's positions cap it)" if plan.largest_model_len < plan.kv_tokens else ""
    console.print(
        f"[bold {colour}]{verdict}[/bold {colour}]; the longest --max-model-len that fits: "
        f"{plan.largest_model_len:,}{capped}"
    )
    for note in plan.notes:
        console.print(f"[dim]note: {note}[/dim]")
