"""DeepSpeed ZeRO model-state memory, with DeepSpeed's own estimator formulas.

``estimate_zero2_model_states_mem_needs`` (deepspeed/runtime/zero/stage_1_and_2.py) and
``estimate_zero3_model_states_mem_needs`` (deepspeed/runtime/zero/stage3.py), restated
here from their published definitions; both assume mixed precision with Adam. DeepSpeed
ships no stage-1 estimator: stage 1 uses the ZeRO paper's 4Ψ + 12Ψ/N (Rajbhandari et al.
2020, Fig. 1)::

    >>> zero2_model_states(1_000_000, gpus_per_node=8, cpu_offload=False).gpu_bytes
    6000000
"""

from __future__ import annotations

from dataclasses import dataclass

# DeepSpeed's defaults (elements), from its ZeRO config documentation.
REDUCE_BUCKET_SIZE = 500_000_000
ALLGATHER_BUCKET_SIZE = 500_000_000
STAGE3_PREFETCH_BUCKET_SIZE = 50_000_000


@dataclass(frozen=True)
class ModelStates:
    """Per-GPU and per-CPU bytes of parameters, gradients and optimizer state."""

    gpu_bytes: int
    cpu_bytes: int
    largest_layer_bytes: int = 0


def zero1_model_states(total_params: int, gpus: int) -> ModelStates:
    """Stage 1: 16-bit parameters and gradients replicated, 12 bytes of fp32 state sharded."""
    return ModelStates(gpu_bytes=4 * total_params + int(12 * total_params / gpus), cpu_bytes=0)


def zero2_model_states(
    total_params: int,
    gpus_per_node: int = 1,
    nodes: int = 1,
    cpu_offload: bool = False,
    buffer_factor: float = 1.5,
) -> ModelStates:
    """DeepSpeed's ``estimate_zero2_model_states_mem_needs``."""
    gpus = nodes * gpus_per_node
    if cpu_offload:
        gpu = 2 * total_params
        cpu = total_params * max(4 * gpus, 16) * buffer_factor
    else:
        gpu = 4 * total_params + int(16 * total_params / gpus)
        cpu = total_params * 4 * gpus_per_node * buffer_factor
    return ModelStates(int(gpu), int(cpu))


def zero3_model_states(
    total_params: int,
    largest_layer_params: int,
    gpus_per_node: int = 1,
    nodes: int = 1,
    cpu_offload: bool = False,
    cpu_offload_params: bool = False,
    zero_init: bool = True,
    buffer_factor: float = 1.5,
) -> ModelStates:
    """DeepSpeed's ``estimate_zero3_model_states_mem_needs``."""
    gpus = nodes * gpus_per_node
    gpus_factor = 1 / nodes
    largest = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu = largest
            cpu = (
                total_params
                * (18 * gpus_factor if zero_init else max(4 * gpus_per_node, 18 * gpus_factor))
                * buffer_factor
            )
        else:
            gpu = largest + int(2 * total_params / gpus)
            cpu = (
                total_params
                * (16 * gpus_factor if zero_init else max(4 * gpus_per_node, 16 * gpus_factor))
                * buffer_factor
            )
    else:
        gpu = largest + int(18 * total_params / gpus)
        cpu = (
            (largest_layer_params if zero_init else total_params)
            * 4
            * gpus_per_node
            * buffer_factor
        )
    return ModelStates(int(gpu), int(cpu), largest)


def bucket_bytes(stage: int, total_params: int, element_bytes: int = 2) -> int:
    """Communication buffers DeepSpeed keeps per GPU with default bucket sizes (16-bit
    elements), never more than the model itself."""
    if stage in (1, 2):
        return element_bytes * min(total_params, REDUCE_BUCKET_SIZE) + element_bytes * min(
            total_params, ALLGATHER_BUCKET_SIZE
        )
    if stage == 3:
        return element_bytes * (
            min(total_params, STAGE3_PREFETCH_BUCKET_SIZE) + min(total_params, REDUCE_BUCKET_SIZE)
        )
    return 0
