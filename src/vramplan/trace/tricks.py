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

import bisect
import contextlib
from collections.abc import Iterator

import torch
import torch.utils.checkpoint as checkpoint_module
from torch import nn

from vramplan.optimizers import DEFAULT_LR, build_optimizer
from vramplan.result import Component, Phase
from vramplan.trace.events import Trace
from vramplan.trace.patching import patched
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


def head_name(model: nn.Module) -> str:
    """The name of ``model``'s output head, where ``Offloader`` pauses ("" without one).

    >>> head_name(nn.Linear(2, 2))
    ''
    """
    head = _output_head(model)
    return next((name for name, m in model.named_modules() if m is head), "")


def offload_candidates(trace: Trace, head: str) -> set[int]:
    """The storages of ``trace``, a step traced without offloading, that ``Offloader``
    may move to the host when the step offloads (their ids): activations a forward pass
    keeps past its end, of ``MIN_OFFLOAD_BYTES`` or more, born before that pass reaches
    the output head ``head`` (a module name; where the offloader pauses). Every other
    storage is alive at the same ops either way: a block's insides that checkpointing
    frees again in forward, a block recomputed in backward (the hooks are off there), the
    head's and the loss's tensors.

    >>> from vramplan.trace.events import Allocation, PhaseMark
    >>> def act(id_, born, died, module=""):
    ...     return Allocation(id_, 4096, Component.ACTIVATIONS, Phase.FORWARD, 1, module, "mm",
    ...                       born, died)
    >>> marks = (PhaseMark(0, Phase.FORWARD, 1), PhaseMark(6, Phase.BACKWARD, 1))
    >>> step = Trace((act(0, 0, 7), act(1, 1, 2), act(2, 3, 8, "lm_head"), act(3, 4, 9)), marks, 10)
    >>> sorted(offload_candidates(step, "lm_head"))
    [0]
    """
    ends = [m.index for m in trace.phases[1:]] + [trace.event_count]
    marks = zip(trace.phases, ends, strict=True)
    spans = [(m.index, end) for m, end in marks if m.phase == Phase.FORWARD]
    starts = [start for start, _ in spans]
    paused = [end for _, end in spans]  # where each pass reaches the head
    for a in trace.allocations:
        if head and (a.module == head or a.module.startswith(head + ".")):
            k = bisect.bisect_right(starts, a.alloc_index) - 1
            if k >= 0 and a.alloc_index < spans[k][1]:
                paused[k] = min(paused[k], a.alloc_index)
    moved = set()
    for a in trace.allocations:
        if a.category != Component.ACTIVATIONS or a.nbytes < MIN_OFFLOAD_BYTES:
            continue
        k = bisect.bisect_right(starts, a.alloc_index) - 1
        if k < 0 or a.alloc_index >= paused[k]:
            continue
        if a.free_index is None or a.free_index >= spans[k][1]:
            moved.add(a.id)
    return moved


class Offloader:
    """torchtune's ``OffloadActivations`` (streams on), with the host copies traced; without
    a recorder (a measured run) the copies are real: pinned host memory out, the device
    back, each copy synchronous where torchtune's side stream overlaps it."""

    def __init__(
        self, recorder: AllocationRecorder | None, model: nn.Module, saves_empty: bool = False
    ) -> None:
        self.recorder = recorder
        self.saves_empty = saves_empty and _SAVES_INPUTS is not None
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
        """Offload the saved tensors of the forward pass run inside; with ``saves_empty``,
        each non-reentrant checkpoint first saves an empty tensor, as PyTorch 2.1 to 2.11
        does (``_saving_empty_first``)."""
        self.paused = False
        empty_first = _saving_empty_first() if self.saves_empty else contextlib.nullcontext()
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack), empty_first:
            yield


_SAVES_INPUTS = getattr(getattr(checkpoint_module, "_CheckpointFrame", None), "save_inputs", None)
"""How the installed PyTorch (2.12 and later) saves a checkpointed call's tensor arguments,
one saved tensor each; None where it saves an empty tensor first itself (2.1 to 2.11)."""


class _SaveEmpty(torch.autograd.Function):
    """What PyTorch 2.1 to 2.11's ``_NoopSaveInputs`` saves before a checkpointed call's
    tensor arguments: ``torch.empty((0,), requires_grad=True)``, through the saved-tensor
    hooks then active."""

    @staticmethod
    def forward(ctx, empty: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(empty)
        return torch.empty((0,))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> None:
        raise AssertionError("the empty tensor's node has no backward")


def _saving_empty_first() -> contextlib.AbstractContextManager:
    """Checkpointing as PyTorch 2.1 to 2.11 saves its inputs: an empty tensor, then the
    tensor arguments; the empty one's node lives as long as the checkpoint's frame."""

    def save_inputs(frame, *args) -> None:
        frame.empty_saver = _SaveEmpty.apply(torch.empty((0,), requires_grad=True))
        _SAVES_INPUTS(frame, *args)

    return patched([(checkpoint_module._CheckpointFrame, "save_inputs", save_inputs)])
