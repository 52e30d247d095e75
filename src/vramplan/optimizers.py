"""Build the optimizer a recipe names; Lion and 8-bit Adam are modelled where missing.

>>> opt = build_optimizer("momentum", [torch.nn.Parameter(torch.zeros(3))], {})
>>> type(opt).__name__, opt.defaults["momentum"]
('SGD', 0.9)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from vramplan.recipe import TORCH_OPTIMIZERS

# Hyper-parameters only change which temporaries a step makes, not the state it keeps;
# these are the common training defaults (weight decay on, as most recipes use).
DEFAULT_LR = 1e-3


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023): one momentum buffer per parameter, updated in place."""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        lr: float = 1e-4,
        betas=(0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = exp_avg.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)
        return None


class Adam8bitModel(torch.optim.Optimizer):
    """The memory layout of bitsandbytes' AdamW8bit / PagedAdamW8bit / PagedAdamW32bit,
    without their kernels (bitsandbytes 0.50 ``optim/optimizer.py``,
    ``Optimizer2State.init_state`` and ``Optimizer8bit.get_state_buffer``).

    8-bit (``bits=8``): parameters with at least ``min_8bit_size`` (4096) elements keep two
    uint8 states, an fp32 absmax per 256-element block for each, and share the optimizer's
    two 256-entry fp32 quantization maps (``qmap1``/``qmap2``, copied to the device once);
    smaller ones keep two fp32 states. 32-bit: two fp32 states. The update is one fused
    kernel, in place: no temporaries.

    Paged (``paged=True``): states of parameters with at least 1e5 elements are allocated
    with ``cudaMallocManaged`` (``F.get_paged``), outside PyTorch's caching allocator, and
    marked ``is_paged``; the driver migrates their pages to the host when the card runs
    short, so they are not counted in the card's peak (the tracer reports them as host
    bytes). Smaller states and the absmax stay ordinary device tensors.
    """

    block = 256
    min_8bit_size = 4096
    min_paged_size = 100_000
    qmap_entries = 256

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        lr: float = DEFAULT_LR,
        bits: int = 8,
        paged: bool = False,
    ) -> None:
        super().__init__(params, {"lr": lr})
        self.bits = bits
        self.paged = paged
        self.qmaps: tuple[torch.Tensor, torch.Tensor] | None = None

    def _buffer(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        buffer = torch.zeros_like(p, dtype=dtype)
        if self.paged and p.numel() >= self.min_paged_size:
            buffer.is_paged = True  # bitsandbytes marks its managed tensors the same way
        return buffer

    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        if self.bits == 8 and p.numel() >= self.min_8bit_size:
            if self.qmaps is None:  # name2qmap["dynamic"/"udynamic"].to(p.device)
                self.qmaps = tuple(
                    torch.zeros(self.qmap_entries, dtype=torch.float32, device=p.device)
                    for _ in range(2)
                )
            blocks = -(-p.numel() // self.block)
            state["state1"] = self._buffer(p, torch.uint8)
            state["qmap1"] = self.qmaps[0]
            state["state2"] = self._buffer(p, torch.uint8)
            state["qmap2"] = self.qmaps[1]
            state["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
            state["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        else:
            state["state1"] = self._buffer(p, torch.float32)
            state["state2"] = self._buffer(p, torch.float32)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                p.add_(p.grad, alpha=-group["lr"])  # bitsandbytes updates in place, no temporaries
        return None


class AdafactorModel(torch.optim.Optimizer):
    """torch.optim.Adafactor's memory: row and column factors of the second moment for
    parameters of two or more dimensions (a full one for vectors), in the gradient's dtype,
    no first moment; one parameter-sized estimate of the second moment at a time.

    (PyTorch's own step reads the step counter with ``.item()``, which fake tensors cannot
    answer, so the same algorithm is written here.)
    """

    def __init__(
        self, params: Iterable[nn.Parameter], lr: float = 1e-2, beta2_decay=-0.8, eps: float = 1e-3
    ) -> None:
        super().__init__(params, {"lr": lr, "beta2_decay": beta2_decay, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad, state = p.grad, self.state[p]
                if not state:
                    if grad.dim() > 1:
                        state["row_var"] = grad.new_zeros(grad.shape[:-1]).unsqueeze(-1)
                        state["col_var"] = grad.new_zeros(
                            grad.shape[:-2] + grad.shape[-1:]
                        ).unsqueeze(-2)
                    else:
                        state["variance"] = torch.zeros_like(grad)
                if grad.dim() > 1:
                    row, col = state["row_var"], state["col_var"]
                    row.lerp_(grad.square().mean(dim=-1, keepdim=True), 0.1)
                    col.lerp_(grad.square().mean(dim=-2, keepdim=True), 0.1)
                    variance = (row @ col).div_(row.mean(dim=-2, keepdim=True))
                else:
                    variance = state["variance"].lerp_(grad.square(), 0.1)
                update = variance.clamp_(min=group["eps"] ** 2).rsqrt_().mul_(grad)
                p.add_(update, alpha=-group["lr"])
        return None


MODELLED = {
    "adafactor": "Adafactor with torch.optim.Adafactor's state layout (row/column "
    "second-moment factors), written here because PyTorch's step reads "
    "its counter with .item()",
    "lion": "Lion (one momentum buffer, implemented here)",
    "adam8bit": "8-bit Adam modelled on bitsandbytes' state layout (uint8 states, "
    "fp32 absmax per 256-element block), not bitsandbytes itself",
    "paged_adamw_8bit": "bitsandbytes' PagedAdamW8bit modelled (8-bit states; those of "
    "parameters of 1e5+ elements in CUDA managed memory, which the driver pages out to the "
    "host under pressure: reported as host bytes, not in the card's peak)",
    "paged_adamw_32bit": "bitsandbytes' PagedAdamW32bit modelled (fp32 states; those of "
    "parameters of 1e5+ elements in CUDA managed memory, which the driver pages out to the "
    "host under pressure: reported as host bytes, not in the card's peak)",
}


def implementation_flags(impl: str, defaults: dict) -> dict:
    """The ``torch.optim`` keyword arguments for an implementation choice: ``auto`` keeps
    the device policy's ``defaults`` (what PyTorch picks by itself there).

    >>> implementation_flags("auto", {"foreach": True})
    {'foreach': True}
    >>> implementation_flags("for-loop", {"foreach": True})
    {'foreach': False}
    >>> implementation_flags("fused", {})
    {'fused': True}
    """
    if impl == "auto":
        return {k: v for k, v in defaults.items() if k == "foreach"}
    if impl == "fused":
        return {"fused": True}
    return {"foreach": impl == "foreach"}


def implementation_note(name: str, impl: str, defaults: dict) -> str | None:
    """What the estimate should say about how a ``torch.optim`` step ran.

    >>> implementation_note("adamw", "auto", {"foreach": True})[:37]
    'optimizer step: foreach (PyTorch 2.0+'
    >>> implementation_note("lion", "auto", {"foreach": True}) is None
    True
    """
    if name not in TORCH_OPTIMIZERS:
        return None
    flags = implementation_flags(impl, defaults)
    if flags.get("fused"):
        return "optimizer step: fused kernels (--optimizer-impl fused), no per-tensor temporaries"
    if flags.get("foreach"):
        how = "PyTorch 2.0+'s default on CUDA" if impl == "auto" else "--optimizer-impl foreach"
        return (
            f"optimizer step: foreach ({how}): temporaries for every parameter at once; "
            "--optimizer-impl fused or for-loop keeps them smaller"
        )
    how = "PyTorch < 2.0's default" if impl == "auto" else "--optimizer-impl for-loop"
    return f"optimizer step: one parameter at a time ({how}), temporaries of one tensor"


def build_optimizer(
    name: str,
    params: list[nn.Parameter],
    defaults: dict,
    impl: str = "auto",
    lr: float = DEFAULT_LR,
) -> torch.optim.Optimizer | None:
    """The optimizer for ``name`` over ``params``; ``defaults`` carries device policy flags
    and ``impl`` the user's implementation choice (``Recipe.optimizer_impl``). The learning
    rate changes values, never memory: a real measured run passes 0 so that random weights
    on synthetic data cannot diverge (a NaN box crashes RoIAlign's CPU kernel)."""
    params = [p for p in params if p.requires_grad]
    if name == "none" or not params:
        return None
    foreach = implementation_flags(impl, defaults)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, **foreach)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, **foreach)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, **foreach)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, **foreach)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, **foreach)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr, **foreach)  # no fused RMSprop
    if name == "adafactor":
        return AdafactorModel(params, lr=lr)
    if name == "lion":
        return Lion(params, lr=lr)
    if name == "adam8bit":
        return Adam8bitModel(params, lr=lr)
    if name == "paged_adamw_8bit":
        return Adam8bitModel(params, lr=lr, bits=8, paged=True)
    if name == "paged_adamw_32bit":
        return Adam8bitModel(params, lr=lr, bits=32, paged=True)
    raise ValueError(f"unknown optimizer {name}")


def optimizer_state_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Every tensor the optimizer keeps between steps."""
    if optimizer is None:
        return []
    found = []
    for state in optimizer.state.values():
        found.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return found


@contextlib.contextmanager
def step_hooks(
    before: Callable[[torch.optim.Optimizer], None], after: Callable[[torch.optim.Optimizer], None]
) -> Iterator[None]:
    """Call ``before(optimizer)`` and ``after(optimizer)`` around every ``optimizer.step()``
    (of any optimizer, the user's own too) run inside the block.

    >>> steps = []
    >>> with step_hooks(lambda o: steps.append("in"), lambda o: steps.append("out")):
    ...     build_optimizer("sgd", [nn.Parameter(torch.zeros(2))], {}).step()
    >>> steps
    ['in', 'out']
    """
    pre = register_optimizer_step_pre_hook(lambda optimizer, *_: before(optimizer))
    post = register_optimizer_step_post_hook(lambda optimizer, *_: after(optimizer))
    try:
        yield
    finally:
        pre.remove()
        post.remove()
