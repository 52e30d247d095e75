"""``Fsdp2(hold_block_inputs=True)`` against PyTorch's own FSDP1 (real CPU tensors, a fake
process group of two ranks): under reentrant checkpointing FSDP1 keeps one more
hidden-state-sized tensor per block already through backward (the block input's gradient,
held by its reshard-only hook) than without; the hold adds the same, less one at the end."""

from __future__ import annotations

import functools
import weakref
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from vramplan.distributed.fsdp import _held_block_inputs, fake_process_group

HIDDEN, TOKENS, BLOCKS = 64, 256, 5
STATE = TOKENS * HIDDEN * 4  # one fp32 hidden state, bytes


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, 4 * HIDDEN, bias=False).requires_grad_(False)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN, bias=False).requires_grad_(False)
        self.lora = nn.Linear(HIDDEN, HIDDEN, bias=False)  # the trainable leaf

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x))) + self.lora(x)


class Stack(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.reentrant = reentrant

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block.__call__, x, use_reentrant=self.reentrant)
        return x.sum()


class _States(TorchDispatchMode):
    """Counts live storages of one hidden state's size; keeps the count at the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, weakref.ref] = {}
        self.peak_bytes, self.states_at_peak = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in [*(out if isinstance(out, (tuple, list)) else [out]), *args]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage._cdata not in self.storages:
                    self.storages[storage._cdata] = weakref.ref(storage)
                    weakref.finalize(storage, self.storages.pop, storage._cdata, None)
        sizes = Counter(s().nbytes() for s in list(self.storages.values()) if s() is not None)
        total = sum(size * n for size, n in sizes.items())
        if total > self.peak_bytes:
            self.peak_bytes, self.states_at_peak = total, sizes[STATE]
        return out


def _states_at_backward_peak(model: nn.Module, hold: bool = False) -> int:
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    model(x).backward()  # a first step (FSDP1's lazy init)
    held = _held_block_inputs(list(model.blocks)) if hold else None
    with held or _nothing(), _States() as states:
        loss = model(x)
        states.peak_bytes = 0
        loss.backward()
    return states.states_at_peak


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _fsdp1(reentrant: bool) -> int:
    from torch.distributed.fsdp import BackwardPrefetch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import (
        _or_policy,
        lambda_auto_wrap_policy,
        transformer_auto_wrap_policy,
    )

    # peft's fsdp_auto_wrap_policy: trainable leaves are units of their own, so a block's
    # unit holds frozen weights only (and gets the reshard-only hook)
    leaves = functools.partial(
        lambda_auto_wrap_policy,
        lambda_fn=lambda m: getattr(m, "weight", None) is not None and m.weight.requires_grad,
    )
    blocks = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    torch.manual_seed(0)
    model = FSDP(
        Stack(reentrant),
        auto_wrap_policy=functools.partial(_or_policy, policies=[leaves, blocks]),
        device_id=torch.device("cpu"),
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        use_orig_params=True,
    )
    model.blocks = model.module.blocks
    return _states_at_backward_peak(model)


@pytest.mark.filterwarnings("ignore")
def test_hold_adds_what_fsdp1_holds_under_reentrant_checkpointing():
    with fake_process_group(2):
        fsdp1_extra = _fsdp1(reentrant=True) - _fsdp1(reentrant=False)
    torch.manual_seed(0)
    held = _states_at_backward_peak(Stack(reentrant=False), hold=True)
    torch.manual_seed(0)
    plain = _states_at_backward_peak(Stack(reentrant=False))
    assert not dist.is_initialized()
    # FSDP1: the input gradient of every block, held until backward ends; the first block's
    # input is a leaf, whose accumulated ``.grad`` is a copy while FSDP1 still holds the
    # gradient (one more state at the very end, which the hold does not add)
    assert fsdp1_extra == BLOCKS
    assert held - plain == BLOCKS - 1
