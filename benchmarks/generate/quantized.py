"""Quantized inference figures (predictions only: no published measurement to compare):

    PYTHONPATH=src python -m benchmarks.generate.quantized

- Qwen2.5-7B ``generate`` on an L4 (prompt 4096, 512 new tokens, fp16) as an int4
  checkpoint run by each kernel, and with each quantized KV cache (bf16 on an A100).
- ``vramplan serve hf:meta-llama-3-8b --gpu h100 --max-model-len 8192`` with GPTQ and
  AWQ weights (Marlin, as vLLM runs both on Hopper).
"""

from __future__ import annotations

import vramplan

GIB = 2**30
QWEN = "hf:qwen2.5-7b"
INT4 = [
    ("fp16 weights", {}),
    ("gptq, marlin", dict(quantize="gptq")),
    ("gptq act-order, marlin", dict(quantize="gptq", act_order=True)),
    ("gptq, exllamav2", dict(quantize="gptq", quant_kernel="exllamav2")),
    ("awq, marlin", dict(quantize="awq")),
    ("awq, gemm", dict(quantize="awq", quant_kernel="gemm")),
]
CACHES = ["dynamic", "quanto", "hqq", "fp8"]


def main() -> None:
    print("| Qwen2.5-7B on L4, fp16, 4096 + 512 | parameters+buffers GiB | peak GiB |")
    print("| --- | ---: | ---: |")
    for label, knobs in INT4:
        est = vramplan.estimate(
            QWEN, gpu="l4", mode="generate", precision="fp16", prompt_len=4096,
            new_tokens=512, **knobs,
        )  # fmt: skip
        resident = est.components["parameters"] + est.components["buffers"]
        print(f"| {label} | {resident / GIB:.2f} | {est.peak.allocated_bytes / GIB:.2f} |")
    print("\n| Qwen2.5-7B on A100, bf16, 30720 + 2048 | KV cache MiB | bytes/token | peak GiB |")
    print("| --- | ---: | ---: | ---: |")
    for cache in CACHES:
        est = vramplan.estimate(
            QWEN, gpu="a100", mode="generate", precision="bf16", prompt_len=30720,
            new_tokens=2048, cache=cache,
        )  # fmt: skip
        g = est.details["generation"]
        print(
            f"| {cache} | {g['kv_cache_bytes'] / 2**20:.1f} | {g['kv_bytes_per_token']:,} "
            f"| {est.peak.allocated_bytes / GIB:.2f} |"
        )
    print("\n| vLLM, Llama-3-8B, H100, 0.9, 8192 | weights GiB | KV cache GiB | tokens |")
    print("| --- | ---: | ---: | ---: |")
    for quantize in ("none", "gptq", "awq", "fp8"):
        plan = vramplan.serve(
            "hf:meta-llama-3-8b", gpu="h100", max_model_len=8192, precision="fp16",
            quantize=quantize,
        )  # fmt: skip
        print(
            f"| {quantize} | {plan.weights_bytes / GIB:.2f} | {plan.kv_cache_bytes / GIB:.2f} "
            f"| {plan.kv_tokens:,} |"
        )


if __name__ == "__main__":
    main()
