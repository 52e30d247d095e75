"""Turn command-line parallelism flags into a ParallelLayout (one clear error each).

>>> layout_from_flags(fsdp=8).describe()
'fsdp dp=8'
>>> layout_from_flags(fsdp=2, fsdp_version=1).describe()
'fsdp dp=2 fsdp-version=1'
>>> layout_from_flags(zero=2, dp=4, offload_optimizer=True).describe()
'zero2 dp=4 offload-optimizer'
"""

from __future__ import annotations

from vramplan.distributed.layout import ParallelLayout
from vramplan.errors import UserError


def layout_from_flags(
    *,
    fsdp: int | None = None,
    world_size: int | None = None,
    shard: str = "full",
    reshard_after_forward: bool = True,
    zero: int | None = None,
    dp: int | None = None,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    tp: int = 1,
    sp: bool = False,
    pp: int = 1,
    microbatches: int = 1,
    fsdp_version: int = 2,
) -> ParallelLayout:
    """The layout the flags ask for; ``ParallelLayout()`` (one GPU) when they ask for none."""
    chosen = [
        name
        for name, value in (("--fsdp", fsdp), ("--world-size", world_size), ("--zero", zero))
        if value is not None
    ]
    if len(chosen) > 1:
        raise UserError(f"choose one of {', '.join(chosen)}")
    if zero is not None and zero not in (1, 2, 3):
        raise UserError(f"ZeRO stage must be 1, 2 or 3, got {zero}")
    if (offload_optimizer or offload_params) and zero is None:
        raise UserError("--offload-optimizer/--offload-params go with --zero")
    if shard not in ("full", "grad-op", "none"):
        raise UserError(f"unknown --shard {shard!r}; choose full, grad-op or none")
    if shard != "full" and world_size is None:
        raise UserError(
            f"--shard {shard} goes with --world-size N (--fsdp N is full sharding; "
            "--fsdp N --no-reshard-after-forward is grad-op)"
        )
    if not reshard_after_forward and fsdp is None and world_size is None:
        raise UserError("--no-reshard-after-forward goes with --fsdp N or --world-size N")
    sharding, degree = "none", 1
    if fsdp is not None or world_size is not None:
        degree = fsdp if fsdp is not None else world_size
        mode = "full" if fsdp is not None else shard
        if mode == "full":
            sharding = "fsdp" if reshard_after_forward else "fsdp-grad-op"
        elif mode == "grad-op":
            sharding = "fsdp-grad-op"
    elif zero is not None:
        sharding, degree = f"zero{zero}", 1 if dp is None else dp
    elif dp is not None:
        degree = dp
    if sp and tp == 1:
        raise UserError("--sp needs --tp > 1")
    return ParallelLayout(
        shard=sharding,
        data_parallel=degree,
        tensor_parallel=tp,
        sequence_parallel=sp,
        pipeline_parallel=pp,
        microbatches=microbatches,
        offload_optimizer=offload_optimizer,
        offload_params=offload_params,
        fsdp_version=fsdp_version,
    )
