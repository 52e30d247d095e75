"""Lightning: a drop-in for ``BatchSizeFinder`` that sets the largest batch that fits the
card before fit, by tracing your ``training_step`` on the CPU (no OOM trial on the GPU)::

    from vramplan.integrations.lightning import VramplanBatchSizeFinder

    trainer = L.Trainer(precision="bf16-mixed", accumulate_grad_batches=4,
                        callbacks=[VramplanBatchSizeFinder(gpu="a10g")])
    trainer.fit(model, datamodule=data)    # model.batch_size (or hparams) set first

Like ``BatchSizeFinder``, it reads and sets ``batch_arg_name`` on the LightningModule (or
its datamodule, or ``hparams``) and takes one batch from the train dataloader; that
batch's shapes, resized to each candidate batch size, are traced through
``training_step``, ``backward`` and the first optimizer of ``configure_optimizers``, under
the Trainer's precision (``precision="bf16-mixed"`` → ``amp-bf16``, ``"bf16-true"`` →
``bf16``...). One GPU's whole step is traced: gradient accumulation keeps the gradients
between micro-batches as the traced step does, and under an FSDP or DeepSpeed strategy each
GPU holds less, so the answer is on the safe side.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from vramplan.api import estimate_step
from vramplan.errors import UserError

try:
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_setattr
except ImportError:  # this module is imported only by those who use it
    raise UserError("lightning is not installed: pip install 'vramplan[lightning]'") from None

PRECISIONS = {
    "32": "fp32",
    "32-true": "fp32",
    "16-mixed": "amp-fp16",
    "bf16-mixed": "amp-bf16",
    "16-true": "fp16",
    "bf16-true": "bf16",
}
LIMIT = 1 << 16


def _precision(trainer: Any) -> str:
    name = str(getattr(trainer, "precision", "32-true"))
    if name not in PRECISIONS:
        raise UserError(
            f"Lightning precision {name!r} is not modelled; choose one of {list(PRECISIONS)}"
        )
    return PRECISIONS[name]


def _resized(batch: Any, old: int, new: int) -> Any:
    """``batch`` with every tensor whose first dimension is ``old`` made ``new`` long
    (uninitialised: only shapes are traced)."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() and batch.shape[0] == old:
            return batch.new_empty((new, *batch.shape[1:]))
        return batch
    if isinstance(batch, dict):
        return {k: _resized(v, old, new) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_resized(v, old, new) for v in batch)
    return batch


def _first_optimizer(configured: Any) -> torch.optim.Optimizer | None:
    if isinstance(configured, torch.optim.Optimizer):
        return configured
    if isinstance(configured, dict):
        return _first_optimizer(configured.get("optimizer"))
    if isinstance(configured, (list, tuple)) and configured:
        return _first_optimizer(configured[0])
    return None


def lightning_step(model: nn.Module, batch: Any, _optimizer: Any) -> None:
    """One Lightning training step on the traced copy: ``training_step``, backward, the
    first optimizer's step."""
    output = model.training_step(batch, 0)
    loss = output["loss"] if isinstance(output, dict) else output
    loss.backward()
    optimizers = model.__dict__.setdefault("_vramplan_optimizer", [])
    if not optimizers:
        optimizers.append(_first_optimizer(model.configure_optimizers()))
    if optimizers[0] is not None:
        optimizers[0].step()
        optimizers[0].zero_grad()


class VramplanBatchSizeFinder(Callback):
    """Set the largest batch that fits ``gpu`` (or ``gpu_memory``) with ``headroom`` free,
    at ``on_fit_start``; ``optimal_batch_size`` holds it afterwards (as in Lightning)."""

    def __init__(
        self,
        gpu: str | None = None,
        gpu_memory: str | None = None,
        headroom: float = 0.10,
        batch_arg_name: str = "batch_size",
    ) -> None:
        if gpu is None and gpu_memory is None:
            raise UserError("give the card: gpu='a10g' (or gpu_memory='24GiB')")
        self.device = {"gpu": gpu, "gpu_memory": gpu_memory, "headroom": headroom}
        self.batch_arg_name = batch_arg_name
        self.optimal_batch_size: int | None = None

    def fits(self, trainer: Any, pl_module: nn.Module, batch: Any, old: int, size: int) -> bool:
        attached = pl_module._trainer
        pl_module._trainer = None  # the traced copy must not copy the Trainer
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # self.log() without a Trainer
                est = estimate_step(
                    lightning_step,
                    pl_module,
                    _resized(batch, old, size),
                    precision=_precision(trainer),
                    **self.device,
                )
        finally:
            pl_module._trainer = attached
        return est.verdict.status == "fits"

    def on_fit_start(self, trainer: Any, pl_module: nn.Module) -> None:
        old = lightning_getattr(pl_module, self.batch_arg_name)
        source = trainer.datamodule if trainer.datamodule is not None else pl_module
        batch = next(iter(source.train_dataloader()))
        low, high = 0, None
        size = 1
        while high is None or high - low > 1:
            if self.fits(trainer, pl_module, batch, old, size):
                low = size
            else:
                high = size
            if high is None and low >= LIMIT:
                break
            size = size * 2 if high is None else (low + high) // 2
        if low == 0:
            raise UserError(f"{type(pl_module).__name__} does not fit even at batch size 1")
        self.optimal_batch_size = low
        lightning_setattr(pl_module, self.batch_arg_name, low)
