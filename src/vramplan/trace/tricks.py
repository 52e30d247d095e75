"""Two recipe tricks of torchtune, applied to the traced step as the libraries apply them.

**Optimizer step in backward** (``--optimizer-in-backward``; torchtune's
``optimizer_in_bwd``, PyTorch's "How to save memory by fusing the optimizer step into the
backward pass" tutorial): one optimizer per parameter, stepped from the parameter's
``register_post_accumulate_grad_hook``, which then sets its gradient to ``None``. Each
gradient dies as soon as its parameter is updated, so the full set never lives at once.

**Activation offloading** (``--activation-offload``; torchtune's ``OffloadActivations``,
``torchtune/training/_activation_offloading.py``): a ``saved_tensors_hooks`` pair. In
forward every saved tensor of at least 1024 bytes that is not an ``nn.Parameter`` or
buffer is copied to (pinned) host memory; the device copy is kept alive only while the
side stream copies it (the last ``max_fwd_stash_size`` = 5 saved tensors). In backward a
tensor still in that stash is used as is; any other is copied back, and each autograd
node's brought-back tensors are released when the next node runs. The output head is not
offloaded (torchtune wraps it in ``NoOpManager``) and the loss is computed outside the
context, so nothing after the head is offloaded either. The host copies are traced,
tagged ``offloaded``, and reported as host RAM instead of device memory::

    offloader = Offloader(recorder, model)
    with offloader.forward():
        loss = model(batch)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from vramplan.optimizers import DEFAULT_LR, build_optimizer
from vramplan.trace.recorder import AllocationRecorder

MIN_OFFLOAD_BYTES = 1024
FORWARD_STASH = 5


def step_in_backward(
    params: list[nn.Parameter], name: str, defaults: dict, lr: float = DEFAULT_LR
) -> list[torch.optim.Optimizer]:
    """An optimizer per trainable parameter, stepped (and its gradient freed) from the
    parameter's post-accumulate-grad hook; returns the optimizers (``lr=0.0`` for a
    measured run, as ``build_optimizer`` takes it)."""
    optimizers = []
    for param in params:
        if not param.requires_grad:
            continue
        optimizer = build_optimizer(name, [param], defaults, lr=lr)
        if optimizer is None:
            continue

        def hook(_param: nn.Parameter, optimizer=optimizer) -> None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        param.register_post_accumulate_grad_hook(hook)
        optimizers.append(optimizer)
    return optimizers


def _output_head(model: nn.Module) -> nn.Module | None:
    get_output = getattr(model, "get_output_embeddings", None)
    head = get_output() if callable(get_output) else None
    return head if isinstance(head, nn.Module) else None


class Offloader:
    """torchtune's ``OffloadActivations`` (streams on), with the host copies traced; without
    a recorder (a measured run) the copies are real: pinned host memory out, the device
    back, each copy synchronous where torchtune's side stream overlaps it."""

    def __init__(self, recorder: AllocationRecorder | None, model: nn.Module) -> None:
        self.recorder = recorder
        self.tracker: dict[int, tuple[torch.Tensor, bool]] = {}
        self.forward_stash: dict[int, torch.Tensor] = {}
        self.backward_stash: dict[int, torch.Tensor] = {}
        self.devices: dict[int, torch.device] = {}
        self.next_id = 0
        self.node = None
        self.first_backward_call = True
        self.paused = False
        head = _output_head(model)
        if head is not None:  # NoOpManager around the head; the loss comes after it
            head.register_forward_pre_hook(lambda *_: self._pause())

    def _pause(self) -> None:
        self.paused = True

    def pack(self, tensor: torch.Tensor) -> int:
        self.next_id += 1
        tensor_id = self.next_id
        self.first_backward_call = True
        size = tensor.element_size() * tensor.nelement()
        if self.paused or size < MIN_OFFLOAD_BYTES or isinstance(tensor, (nn.Parameter, nn.Buffer)):
            self.tracker[tensor_id] = (tensor, False)
            return tensor_id
        for old in [k for k in self.forward_stash if k <= tensor_id - FORWARD_STASH]:
            del self.forward_stash[old]  # the side stream has copied it: the device copy dies
        if self.recorder is None:
            host = torch.empty(
                tensor.size(), dtype=tensor.dtype, device="cpu", pin_memory=tensor.is_cuda
            )
            host.copy_(tensor)
        else:
            host = torch.empty_like(tensor)
            record = self.recorder.record_for(host)
            if record is not None:
                record.tags.add("offloaded")
                record.op = "offload_to_host"
        self.tracker[tensor_id] = (host, True)
        self.devices[tensor_id] = tensor.device
        self.forward_stash[tensor_id] = tensor
        return tensor_id

    def unpack(self, tensor_id: int) -> torch.Tensor:
        if self.first_backward_call:
            self.first_backward_call = False
            torch.autograd.Variable._execution_engine.queue_callback(self.backward_stash.clear)
        tensor, offloaded = self.tracker.pop(tensor_id)
        if not offloaded:
            return tensor
        node = torch._C._current_autograd_node()
        previous = []
        if node is not self.node:  # a new node: the previous node's tensors go after it runs
            self.node = node
            previous = list(self.backward_stash)
        if tensor_id in self.forward_stash:
            tensor = self.forward_stash[tensor_id]
        elif self.recorder is None:
            tensor = tensor.to(self.devices[tensor_id])  # copied back to the card
            self.backward_stash[tensor_id] = tensor
        else:
            tensor = torch.empty_like(tensor)  # copied back to the card
            record = self.recorder.record_for(tensor)
            if record is not None:
                record.op = "reload_from_host"
            self.backward_stash[tensor_id] = tensor
        self.devices.pop(tensor_id, None)

        def release(outputs, _inputs):
            self.forward_stash.clear()
            for old in previous:
                self.backward_stash.pop(old, None)
            return outputs

        if node is not None:
            node.register_hook(release)
        return tensor

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Offload the saved tensors of the forward pass run inside."""
        self.paused = False
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield
