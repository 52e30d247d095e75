"""Each layer of the bill, per workload: tensors (allocated), the caching allocator
(reserved), and the runtime outside PyTorch (device total), with the runtime terms.

    python benchmarks/device_layers.py
"""

from __future__ import annotations

from vramplan.device.options import device_options
from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe
from vramplan.sources import resolve

WORKLOADS = [
    ("resnet50 b64 fp32", "torchvision:resnet50", Recipe(batch_size=64), "a100"),
    ("resnet50 b64 fp32 benchmark", "torchvision:resnet50", Recipe(batch_size=64), "a100"),
    ("vgg16 b32 fp32", "torchvision:vgg16", Recipe(batch_size=32, optimizer="sgd"), "a100"),
    (
        "vit_b_16 b32 amp",
        "torchvision:vit_b_16",
        Recipe(batch_size=32, precision="amp-bf16"),
        "h100",
    ),
    (
        "gpt2 b8 s1024 amp",
        "hf:gpt2",
        Recipe(batch_size=8, seq_len=1024, precision="amp-bf16"),
        "a100-40gb",
    ),
    ("bert-base b16 s512", "hf:bert-base-uncased", Recipe(batch_size=16, seq_len=512), "l4"),
    (
        "gpt2 b8 s1024 expandable",
        "hf:gpt2",
        Recipe(batch_size=8, seq_len=1024, precision="amp-bf16"),
        "a100-40gb",
    ),
]
MiB = 2**20


def main() -> None:
    print(
        "| workload | gpu | tensors MiB | allocated MiB | reserved MiB | device total MiB | "
        "reserved/allocated | runtime terms (MiB) |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, spec, recipe, gpu in WORKLOADS:
        options = device_options(
            gpu=gpu,
            cudnn_benchmark="benchmark" in name,
            alloc_conf="expandable_segments:True" if "expandable" in name else None,
        )
        est = estimate_built(resolve(spec, recipe), recipe, "cuda", options)
        peak = est.peak
        terms = ", ".join(f"{k} {v / MiB:.0f}" for k, v in est.runtime.items() if v)
        print(
            f"| {name} | {gpu} | {est.details['tensor_allocated_bytes'] / MiB:.0f} | "
            f"{peak.allocated_bytes / MiB:.0f} | {peak.reserved_bytes / MiB:.0f} | "
            f"{peak.device_total_bytes / MiB:.0f} | "
            f"{peak.reserved_bytes / peak.allocated_bytes:.2f} | {terms} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
