"""``vramplan serve``: what a serving engine reserves on a card, and its KV cache.

$ vramplan serve hf:meta-llama-3-8b --gpu h100 --max-model-len 8192
"""

from __future__ import annotations

from typing import Annotated

import typer

import vramplan
from vramplan.cli.app import app
from vramplan.cli.options import (
    ActOrderOpt,
    GpuOpt,
    GroupSizeOpt,
    JsonOpt,
    Model,
    PrecisionOpt,
    QuantizeOpt,
    QuantKernelOpt,
    StackOpt,
    TimeoutOpt,
    TpOpt,
    UnitsOpt,
)
from vramplan.report.render import check_units, print_json
from vramplan.report.serve import render_serving

EngineOpt = Annotated[str, typer.Option("--engine", help="The serving engine: vllm.")]
UtilizationOpt = Annotated[
    float,
    typer.Option(
        "--gpu-memory-utilization", help="Share of the card the engine may use (vLLM's flag)."
    ),
]
MaxModelLenOpt = Annotated[
    int | None,
    typer.Option("--max-model-len", help="Longest sequence (default: the model's positions)."),
]
MaxNumSeqsOpt = Annotated[
    int | None,
    typer.Option("--max-num-seqs", help="Sequences per step (default: vLLM's for the card)."),
]
MaxBatchedOpt = Annotated[
    int | None,
    typer.Option(
        "--max-num-batched-tokens",
        help="Tokens per step, the profile run's size (default: vLLM's for the card).",
    ),
]
KvDtypeOpt = Annotated[str, typer.Option("--kv-cache-dtype", help="auto (the model's) | fp8.")]
BlockSizeOpt = Annotated[int, typer.Option("--block-size", help="Tokens per KV cache block.")]


@app.command("serve")
def serve_command(
    model: Model,
    gpu: GpuOpt = None,
    engine: EngineOpt = "vllm",
    gpu_memory_utilization: UtilizationOpt = 0.9,
    max_model_len: MaxModelLenOpt = None,
    tp: TpOpt = 1,
    max_num_seqs: MaxNumSeqsOpt = None,
    max_num_batched_tokens: MaxBatchedOpt = None,
    kv_cache_dtype: KvDtypeOpt = "auto",
    block_size: BlockSizeOpt = 16,
    precision: PrecisionOpt = "bf16",
    quantize: QuantizeOpt = "none",
    group_size: GroupSizeOpt = None,
    quant_kernel: QuantKernelOpt = None,
    act_order: ActOrderOpt = False,
    stack: StackOpt = None,
    timeout: TimeoutOpt = 300.0,
    json_output: JsonOpt = False,
    units: UnitsOpt = "binary",
) -> int:
    """What a serving engine (vLLM) reserves at start-up, and the KV cache left: bytes,
    tokens, concurrent sequences, and the longest --max-model-len that fits."""
    check_units(units)
    if gpu is None:
        raise vramplan.UserError("serve needs --gpu: the engine's budget is a share of the card")
    plan = vramplan.serve(
        model,
        gpu=gpu,
        stack=stack,
        timeout=timeout,
        engine=engine,
        gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=max_model_len,
        tp=tp,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        kv_cache_dtype=kv_cache_dtype,
        block_size=block_size,
        precision=precision,
        quantize=quantize,
        group_size=group_size,
        quant_kernel=quant_kernel,
        act_order=act_order,
    )
    if json_output:
        print_json(plan.to_json())
    else:
        render_serving(plan, units)
    return 0 if plan.fits else 3
