"""Generation and serving figures beside published measurements (prints errors; not run
by CI):

    PYTHONPATH=src python -m benchmarks.generate.published

- Qwen2.5-7B ``generate`` on an A100, bf16 with flash attention, prompt S - 2048 and
  2048 new tokens: ``torch.cuda.max_memory_allocated`` about 14.4 / 16.9 / 20.0 GiB for
  S = 2049 / 16384 / 32768 (issue 21).
- bigcode/octocoder ``pipeline(..., max_new_tokens=60)`` on a ~20-token prompt, bf16
  and 4-bit bitsandbytes (rows 93 and 95 of /work/shared/validation/published.csv). The
  4-bit row ran ``load_in_4bit=True`` on transformers ~4.33 and bitsandbytes ~0.41: fp4,
  compute dtype float32 (``BitsAndBytesConfig``'s default when none is given), and 0.41's
  ``MatMul4Bit`` dequantizing to fp16 before casting to the compute dtype.
- ``vllm serve`` of Llama-3-8B on an H100 at 0.9 utilization: weights 14.96 GiB, KV cache
  about 53 GiB (issue 21), and the llm-d H100 table (Llama-3.1-8B: weights 14.99,
  activation 4.76, non-torch 0.13, KV cache 51.38 GiB; llm-d/llm-d-benchmark
  config_explorer/empirical-vllm-memory-results.md).
"""

from __future__ import annotations

import time
from pathlib import Path

import vramplan

GIB = 2**30
HERE = Path(__file__).parent
OCTOCODER = f"hf:{HERE / 'octocoder.json'}"

GENERATE = [
    ("Qwen2.5-7B S=2049", "hf:qwen2.5-7b", "a100", dict(prompt_len=1, new_tokens=2048), 14.4),
    ("Qwen2.5-7B S=16384", "hf:qwen2.5-7b", "a100", dict(prompt_len=14336, new_tokens=2048), 16.9),
    ("Qwen2.5-7B S=32768", "hf:qwen2.5-7b", "a100", dict(prompt_len=30720, new_tokens=2048), 20.0),
    ("octocoder bf16 (row 93)", OCTOCODER, "a100-40gb", dict(prompt_len=20, new_tokens=60), 29.026),
    (
        "octocoder 4-bit (row 95)",
        OCTOCODER,
        "a100-40gb",
        dict(
            prompt_len=20, new_tokens=60, quantize="fp4", compute_dtype="fp32", bnb_version="0.41"
        ),
        9.544,
    ),
]


def _generate_rows() -> list[str]:
    rows = [
        "| case | vramplan allocated GiB | measured GiB | error | prefill / decode GiB "
        "| KV cache MiB |",
        "| --- | ---: | ---: | ---: | --- | ---: |",
    ]
    for label, model, gpu, knobs, measured in GENERATE:
        start = time.perf_counter()
        precision = "bf16" if "quantize" not in knobs else "fp16"
        est = vramplan.estimate(model, gpu=gpu, mode="generate", precision=precision, **knobs)
        g = est.details["generation"]
        got = est.peak.allocated_bytes / GIB
        rows.append(
            f"| {label} | {got:.2f} | {measured:.2f} | {100 * (got - measured) / measured:+.1f}% "
            f"| {g['prefill_peak_bytes'] / GIB:.2f} / {g['decode_peak_bytes'] / GIB:.2f} "
            f"| {g['kv_cache_bytes'] / 2**20:.1f} |"
        )
        print(rows[-1], f"({time.perf_counter() - start:.0f} s)", flush=True)
    return rows


def _serve_rows() -> list[str]:
    plan = vramplan.serve(
        "hf:meta-llama-3-8b", gpu="h100", gpu_memory_utilization=0.9, max_model_len=8192
    )
    figures = [
        ("weights", plan.weights_bytes, 14.96, 14.99),
        ("profile-run peak", plan.activation_peak_bytes, None, 4.76),
        ("non-torch", plan.non_torch_bytes, None, 0.13),
        ("KV cache", plan.kv_cache_bytes, 53.0, 51.38),
    ]
    rows = [
        "| vLLM on H100, 0.9 | vramplan GiB | issue 21 (vLLM log) | error "
        "| llm-d Llama-3.1-8B | error |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, value, issue, llmd in figures:
        got = value / GIB
        first = f"{issue:.2f} | {100 * (got - issue) / issue:+.1f}%" if issue else "- | -"
        rows.append(
            f"| {name} | {got:.2f} | {first} | {llmd:.2f} | {100 * (got - llmd) / llmd:+.1f}% |"
        )
        print(rows[-1], flush=True)
    rows.append(
        f"\nKV cache: {plan.kv_tokens:,} tokens, {plan.max_concurrency:.1f}x at 8192 tokens"
    )
    return rows


def main() -> None:
    lines = ["# Generation and serving beside published figures", ""]
    lines += _generate_rows() + [""] + _serve_rows()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
