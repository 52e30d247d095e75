"""Past one GPU: per-rank memory under ZeRO/FSDP sharding, tensor and pipeline parallelism,
CPU offload, and how many GPUs a step needs."""
