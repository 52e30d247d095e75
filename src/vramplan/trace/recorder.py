"""Record every storage allocation and free of code running under fake tensors.

``AllocationRecorder`` is a ``TorchDispatchMode``: it sees each ATen op's outputs, notes
each storage it has not seen, and learns of frees through a weak-reference finalizer on
the storage. Categories are settled afterwards (``categorize.py``)::

    with FakeTensorMode() as fake, AllocationRecorder() as rec:
        x = torch.randn(4, 4)
    rec.records[0].nbytes  # 64
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from vramplan.collector import resume
from vramplan.ops import Library, library_of
from vramplan.result import Phase
from vramplan.trace.accumulation import ADD, INDEX_PUT, accumulates, index_backward_put
from vramplan.trace.arguments import bound_arguments
from vramplan.trace.events import PhaseMark
from vramplan.trace.kernel_scratch import ATTENTION_KERNELS, CONTIGUOUS_FIRST, REDUCTIONS
from vramplan.trace.modules import ModuleStack


@dataclass(frozen=True)
class OpMarker:
    """Where a library-backed op ran: after event ``index``, with its tensor bytes."""

    index: int
    phase: Phase
    op: str
    input_bytes: int
    output_bytes: int
    # What the device model needs to pick a cuDNN engine (empty for other ops):
    input_shape: tuple[int, ...] = ()
    weight_shape: tuple[int, ...] = ()
    output_shape: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    padding: tuple[int, ...] = ()
    dilation: tuple[int, ...] = ()
    groups: int = 1
    transposed: bool = False
    output_padding: tuple[int, ...] = ()
    dtype: str = ""
    memory_format: str = "contiguous"
    passes: tuple[str, ...] = ()
    """``forward``, or the ``backward_data`` / ``backward_filter`` passes a backward runs."""
    pass_lags: tuple[int, ...] = ()
    """For each pass, how many events before ``index`` it runs: after the allocation of the
    tensor it writes (PyTorch's cuDNN backward allocates the input's gradient, runs the
    data pass, then allocates the weight's gradient and runs the filter pass); empty, all
    at ``index``."""


SCRATCH_OPS = frozenset((*REDUCTIONS, *ATTENTION_KERNELS, *CONTIGUOUS_FIRST))
"""The ops whose CUDA kernels take scratch of their own (``kernel_scratch.py``)."""
_DEVICE_QUERY = torch.ops.prim.device.default
"""``tensor.device`` on a fake tensor: a metadata query, dispatched like an op but run by
no kernel, and asked as often as Python code happens to ask (not counted)."""


def _shape(value) -> tuple[int, ...]:
    return tuple(int(v) for v in value.shape) if isinstance(value, torch.Tensor) else ()


def _ints(value) -> tuple[int, ...]:
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else ()


def conv_fields(func, args, kwargs, out) -> dict:
    """Shapes, strides, groups, dtype and passes of a convolution call, read by argument
    name from the op's schema (``convolution``, ``convolution_backward``,
    ``cudnn_convolution`` name them differently)."""
    try:
        bound = bound_arguments(func, args, kwargs)
    except AttributeError:
        return {}
    x = bound.get("input", bound.get("self"))
    weight = bound.get("weight")
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return {}
    mask = bound.get("output_mask")
    if mask is not None:
        wanted = zip(("backward_data", "backward_filter"), mask[:2], strict=True)
        passes = tuple(name for name, on in wanted if on)
        y = bound.get("grad_output")
    else:
        passes = ("forward",)
        y = out if isinstance(out, torch.Tensor) else None
    transposed = bool(bound.get("transposed", False))
    channels_last = (
        x.dim() == 4
        and x.is_contiguous(memory_format=torch.channels_last)
        and (not x.is_contiguous())
    )
    return {
        "input_shape": _shape(x),
        "weight_shape": _shape(weight),
        "output_shape": _shape(y),
        "stride": _ints(bound.get("stride")),
        "padding": _ints(bound.get("padding")),
        "dilation": _ints(bound.get("dilation")),
        "groups": int(bound.get("groups") or 1),
        "transposed": transposed,
        "output_padding": _ints(bound.get("output_padding")) if transposed else (),
        "dtype": str(x.dtype).removeprefix("torch."),
        "memory_format": "channels_last" if channels_last else "contiguous",
        "passes": passes,
    }


def _tensor_bytes(tree) -> int:
    return sum(
        t.numel() * t.element_size() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)
    )


@dataclass
class StorageRecord:
    """A storage as it is being traced; frozen into an ``Allocation`` at the end."""

    id: int
    key: int
    nbytes: int
    phase: Phase
    iteration: int
    module: str
    op: str
    alloc_index: int
    free_index: int | None = None
    tags: set[str] = field(default_factory=set)
    stream: int = 0


def plain_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors holding memory behind ``tensor``: itself, or the inner tensors of a
    wrapper subclass such as a DTensor (its local shard)."""
    if type(tensor) is FakeTensor or not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    inners = (getattr(tensor, name) for name in names)  # a DTensor also names its mesh
    return [p for inner in inners if isinstance(inner, torch.Tensor) for p in plain_tensors(inner)]


def storage_key(tensor: torch.Tensor) -> int:
    """Identity of a tensor's storage (shared by all its views)."""
    return tensor.untyped_storage()._cdata


class AllocationRecorder(TorchDispatchMode):
    """Dispatch mode that logs storage births and deaths with phase and module."""

    def __init__(
        self, modules: ModuleStack | None = None, counter: Any = None, scratch: Any = None
    ) -> None:
        super().__init__()
        self.counter = counter
        """Told of every op (``count(func, args, kwargs, out)``), paused or not: the FLOP
        counter (``flops.TotalFlops``), None when nothing counts."""
        self.scratch = scratch
        """Sizes the scratch a device kernel takes inside an op (``sizes(name, func, args,
        kwargs)``, ``kernel_scratch.KernelScratch``): recorded after the op's outputs and
        freed at once; None on the CPU."""
        resume()  # frees of storages in reference cycles are seen when the collector runs
        self.records: list[StorageRecord] = []
        self.live: dict[int, StorageRecord] = {}
        self.phases: list[PhaseMark] = [PhaseMark(0, Phase.SETUP, 0)]
        self.event_count = 0
        self.modules = modules or ModuleStack()
        self._optimizer_depth = 0
        self._closed = False
        self.op_counts: dict[tuple[str, str], int] = {}
        self.markers: list[OpMarker] = []
        self.stream = 0
        """The stream new storages are allocated on (0: the default stream)."""
        self.stream_label = ""
        """What the current side stream is for; prefixes the op names it allocates."""
        self._paused = 0
        self.accumulating = False
        """Between a backward node and the next: an ``add`` is autograd's accumulation."""
        self.summing: tuple[StorageRecord, StorageRecord] | None = None
        """The op just dispatched that real tensors run in place (a gradient sum, index's
        backward scatter): (result, first operand). If the operand dies before the next op,
        the result was made in its storage (``accumulation.py``)."""
        self.continued: dict[int, StorageRecord] = {}
        """A sum's record id: the operand record whose bytes it took over."""

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Record nothing inside: work that is not the step's (capturing a compiled graph)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    # -- phases -----------------------------------------------------------------------
    def set_phase(self, phase: Phase, iteration: int) -> None:
        """Mark that the step enters ``phase`` of ``iteration`` from the next event on."""
        last = self.phases[-1]
        if (last.phase, last.iteration) == (phase, iteration):
            return
        if last.index == self.event_count:
            self.phases[-1] = PhaseMark(self.event_count, phase, iteration)
        else:
            self.phases.append(PhaseMark(self.event_count, phase, iteration))

    def enter_optimizer(self) -> None:
        self._optimizer_depth += 1

    def leave_optimizer(self) -> None:
        self._optimizer_depth = max(0, self._optimizer_depth - 1)

    def current_phase(self) -> tuple[Phase, int]:
        """Backward while the autograd engine runs, optimizer inside ``step()``, else the mark."""
        mark = self.phases[-1]
        if torch._C._current_graph_task_id() != -1:
            return Phase.BACKWARD, mark.iteration
        if self._optimizer_depth:
            return Phase.OPTIMIZER, mark.iteration
        return mark.phase, mark.iteration

    # -- storages ---------------------------------------------------------------------
    def track(self, tensor: torch.Tensor, op: str) -> StorageRecord | None:
        """Register a tensor's storage if it is new; return its record (the last inner
        tensor's for a wrapper subclass)."""
        record = None
        for plain in plain_tensors(tensor):
            storage = plain.untyped_storage()
            nbytes = storage.nbytes()
            record = self.live.get(storage._cdata)
            if record is not None and record.nbytes != nbytes:  # grown in place (``out=``)
                self.on_resize(storage, nbytes)
                record = self.live.get(storage._cdata)
            elif record is None and nbytes:
                record = self._new_record(storage, nbytes, op)
        return record

    def on_resize(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """A storage was resized in place (FSDP frees and re-allocates its unsharded
        parameters this way): the old size dies, the new one is born."""
        if self._paused:
            return
        record = self.live.get(storage._cdata)
        if record is not None and record.nbytes == nbytes:
            return
        if record is not None:
            self._on_free(record)
        if nbytes:
            self._new_record(storage, nbytes, "resize_storage").tags.add("resized")

    def _new_record(self, storage: torch.UntypedStorage, nbytes: int, op: str) -> StorageRecord:
        record = self._append(storage._cdata, nbytes, op)
        self.live[record.key] = record
        weakref.finalize(storage, self._on_free, record)
        return record

    def adopt(self, tensor: torch.Tensor) -> None:
        """Know ``tensor``'s storage without recording its birth or its death: a storage
        whose events are written elsewhere (``copied_iteration.py``'s remade gradients).
        Ops that return it in place then find it instead of recording it as new."""
        storage = tensor.untyped_storage()
        record = StorageRecord(-1, storage._cdata, storage.nbytes(), Phase.OPTIMIZER, 0, "", "", -1)
        record.free_index = -1  # already settled: its free is not an event
        self.live[record.key] = record
        weakref.finalize(storage, self._on_free, record)

    def note_alloc(self, nbytes: int, op: str) -> StorageRecord:
        """Record a storage no tensor holds: a step the tracer models without running it
        (the cache growth of generation's decode steps); ``note_free`` ends it."""
        return self._append(-1 - len(self.records), nbytes, op)

    def note_free(self, record: StorageRecord) -> None:
        """End a storage recorded by ``note_alloc``."""
        self._on_free(record)

    def note_scratch(self, buffers) -> None:
        """Storages a kernel takes inside an op, as (bytes, op name) pairs: recorded after
        the op's outputs and freed before it returns, in reverse order."""
        held = [self.note_alloc(nbytes, op) for nbytes, op in buffers]
        for record in reversed(held):
            self.note_free(record)

    def _append(self, key: int, nbytes: int, op: str) -> StorageRecord:
        if self.stream_label:
            op = f"{self.stream_label}:{op}"
        phase, iteration = self.current_phase()
        self._sync_phase_mark(phase, iteration)
        record = StorageRecord(
            id=len(self.records),
            key=key,
            nbytes=nbytes,
            phase=phase,
            iteration=iteration,
            module=self.modules.innermost(),
            op=op,
            alloc_index=self.event_count,
            stream=self.stream,
        )
        self.event_count += 1
        self.records.append(record)
        return record

    def record_for(self, tensor: torch.Tensor) -> StorageRecord | None:
        """The live record of a tensor's storage (a wrapper's first inner tensor), if it
        was traced."""
        return self.live.get(storage_key(plain_tensors(tensor)[0]))

    def _on_free(self, record: StorageRecord) -> None:
        if self._closed:
            return
        operand = self.continued.pop(record.id, None)  # a sum made in an operand's bytes
        current = self.live.get(record.key)
        if current is record or (current is not None and current is operand):
            del self.live[record.key]
        bytes_record = operand or record
        if self.summing is not None and bytes_record is self.summing[1]:
            self._continue(*self.summing)
            return
        self._end(bytes_record)

    def _end(self, record: StorageRecord) -> None:
        if record.free_index is None:
            phase, iteration = self.current_phase()
            self._sync_phase_mark(phase, iteration)
            record.free_index = self.event_count
            self.event_count += 1

    def _sync_phase_mark(self, phase: Phase, iteration: int) -> None:
        last = self.phases[-1]
        if (last.phase, last.iteration) != (phase, iteration):
            self.phases.append(PhaseMark(self.event_count, phase, iteration))

    def close(self) -> None:
        """Stop listening for frees: storages still alive stay alive in the trace."""
        self._closed = True
        self.live.clear()

    def opened(self, accumulating: bool) -> None:
        """``accumulation.backward_in_place``'s switch."""
        self.accumulating = accumulating

    def _sums_into(self, out: torch.Tensor, operand: torch.Tensor) -> None:
        """Expect ``out`` to have been made in ``operand``'s storage, as the op runs in place
        on real tensors: so written where ``operand`` dies before the next op."""
        total, first = self.record_for(out), self.record_for(operand)
        if total is not None and first is not None and total.nbytes == first.nbytes:
            self.summing = (total, first)

    def _continue(self, total: StorageRecord, operand: StorageRecord) -> None:
        """The sum was made in the operand's storage: the operand lives on as the sum
        (its bytes, its tags to come, its death when the sum's storage dies); the sum's own
        record holds no bytes and ends at once."""
        self.summing = None
        total.nbytes = 0
        self._end(total)  # an empty record, ended here (where the operand's free would be)
        self.continued[total.id] = operand
        if self.live.get(total.key) is total:
            self.live[total.key] = operand

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE_QUERY and isinstance(args[0], FakeTensor):
            return args[0].device  # FakeTensorMode's answer, without its dispatch
        kwargs = kwargs or {}
        before = self.event_count
        out = func(*args, **kwargs)
        if self.counter is not None:
            self.counter.count(func, args, kwargs, out)
        if self._paused or func is _DEVICE_QUERY:
            return out
        name, convolution = _OP_FACTS.get(func) or _op_facts(func)
        phase_key = (self.current_phase()[0], name)
        self.op_counts[phase_key] = self.op_counts.get(phase_key, 0) + 1
        for item in (out,) if isinstance(out, torch.Tensor) else tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor) and item.device.type != "meta":
                self.track(item, name)
        self.summing = None
        if self.accumulating:  # the engine sums a node's gradients before anything else
            if func is ADD and accumulates(out, *args[:2]):
                self._sums_into(out, args[0])
            else:
                self.accumulating = False
        elif func is INDEX_PUT and index_backward_put(args, kwargs):
            self._sums_into(out, args[0])  # in place into index's zeros on real tensors
        if self.scratch is not None and name in SCRATCH_OPS:
            sizes = self.scratch.sizes(name, func, args, kwargs)
            self.note_scratch((nbytes, f"{name}:scratch") for nbytes in sizes)
        if convolution:  # cuDNN: a workspace marker
            fields = conv_fields(func, args, kwargs, out)
            self.markers.append(
                OpMarker(
                    self.event_count - 1,
                    phase_key[0],
                    name,
                    _tensor_bytes((args, kwargs)),
                    _tensor_bytes(out),
                    **fields,
                    pass_lags=self._pass_lags(fields.get("passes", ()), out, before),
                )
            )
        return out

    def _pass_lags(self, passes: tuple[str, ...], out, before: int) -> tuple[int, ...]:
        """``OpMarker.pass_lags`` of a convolution whose events began at ``before``: each
        backward pass after the allocation of the gradient it writes, where this op made it."""
        written = {"backward_data": 0, "backward_filter": 1}
        lags = []
        for name in passes:
            index = written.get(name)
            tensor = out[index] if index is not None and isinstance(out, tuple) else None
            record = self.record_for(tensor) if isinstance(tensor, torch.Tensor) else None
            made_here = record is not None and record.alloc_index >= before
            lags.append(self.event_count - 1 - record.alloc_index if made_here else 0)
        return tuple(lags)


_OP_FACTS: dict[Any, tuple[str, bool]] = {}
"""Each op's name as op counts spell it and whether it runs in cuDNN's convolutions, asked
of every op dispatched: found once per op."""


def _op_facts(func) -> tuple[str, bool]:
    """``_OP_FACTS[func]``, found and kept.

    >>> _op_facts(torch.ops.aten.convolution.default)
    ('convolution', True)
    """
    name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
    facts = _OP_FACTS[func] = (name, library_of(func) is Library.CONVOLUTION)
    return facts


@contextlib.contextmanager
def storage_resizes(recorder: AllocationRecorder) -> Iterator[None]:
    """Report ``UntypedStorage.resize_`` calls to ``recorder`` (no dispatch mode sees them;
    PyTorch's own MemTracker patches the method the same way)."""
    original = torch.UntypedStorage.resize_

    def resize_(storage: torch.UntypedStorage, size: int):
        result = original(storage, size)
        recorder.on_resize(storage, int(size))
        return result

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original
