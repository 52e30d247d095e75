"""The scratch buffers PyTorch's CPU convolution kernels allocate inside the op.

A fake trace sees a convolution's outputs, not what its CPU kernel allocates while it runs.
``at::_convolution`` picks the kernel (``_select_conv_backend`` in
``aten/src/ATen/native/Convolution.cpp``); the slow kernels unfold their input into a
columns buffer (im2col) taken with ``at::empty`` from the CPU allocator and freed before the
op returns (PyTorch 2.x, read at 2.14):

- ``Slow2d`` (``ConvolutionMM2d.cpp``, ``compute_columns2d``): forward, the whole batch's
  columns, N x C_in*kH*kW x H_out*W_out, taken before the output; backward, the same again for
  the weight gradient (the input gradient's per-thread buffer is a ``std::make_unique``, not
  the allocator's). A 1x1 kernel with stride 1 and no padding views its input instead.
- ``Slow3d`` (``ConvolutionMM3d.cpp``, ``compute_columns3d``): likewise over kT*kH*kW (all
  C_in, whatever the groups; the view needs groups 1 too); backward takes ``fgrad_input`` of
  that size for the input gradient even for a 1x1x1 kernel, then the columns for the weight.
- ``SlowDilated2d``/``SlowDilated3d`` (``NaiveDilatedConvolution.cpp``): one sample's
  columns, C_in*prod(k) x prod(out), reused across the batch, in forward and backward; the
  bias gradient sums each sample into a C_out temporary while the columns live.
- all four: a contiguous copy of a strided input (``at::_convolution``,
  ``convolution_backward``) and of a strided ``grad_output`` (the kernels'
  ``grad_output.contiguous()``), alive with the columns.

``Mkldnn`` (oneDNN) books its scratchpad through PyTorch's CPU allocator too, of a size set
by the implementation oneDNN picks for the CPU's instruction set; it is not modelled here::

    >>> call = ConvCall((1, 16, 8, 8), (32, 16, 3, 3), (1, 1), (1, 1), (1, 1))
    >>> cpu_conv_backend(call, Host(threads=2))
    'Slow2d'
    >>> [(b.name, b.nbytes) for b in scratch(call, "Slow2d", ("forward",))]
    [('columns', 36864)]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from vramplan.trace.arguments import bound_arguments

aten = torch.ops.aten


@dataclass(frozen=True)
class Host:
    """What the selection reads of the machine: threads, oneDNN on, its bf16/fp16 kernels."""

    threads: int = 1
    mkldnn: bool = True
    mkldnn_bf16: bool = False
    mkldnn_fp16: bool = False

    @classmethod
    def here(cls) -> Host:
        """This process: ``at::get_num_threads()``, ``torch.backends.mkldnn`` and the CPU
        checks ``mkldnn_bf16_device_check`` / ``mkldnn_fp16_device_check``."""
        available = torch.backends.mkldnn.is_available()
        return cls(
            threads=torch.get_num_threads(),
            mkldnn=available and torch.backends.mkldnn.enabled,
            mkldnn_bf16=available and torch.ops.mkldnn._is_mkldnn_bf16_supported(),
            mkldnn_fp16=available and torch.ops.mkldnn._is_mkldnn_fp16_supported(),
        )


@dataclass(frozen=True)
class ConvCall:
    """One convolution as ``_select_conv_backend`` sees it (batched input, N first)."""

    input_shape: tuple[int, ...]
    weight_shape: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    transposed: bool = False
    groups: int = 1
    dtype: torch.dtype = torch.float32
    output_padding: tuple[int, ...] = ()

    @classmethod
    def of(cls, func, args, kwargs) -> ConvCall | None:
        """The call of ``aten.convolution`` / ``aten.convolution_backward``, read by argument
        name; None for an input that is not a plain strided CPU tensor."""
        bound = bound_arguments(func, args, kwargs)
        x, weight = bound["input"], bound["weight"]
        if x.layout != torch.strided or x.device.type != "cpu" or x.is_complex():
            return None
        spatial = weight.dim() - 2
        if x.dim() == spatial + 1:  # unbatched
            return None

        def ints(name: str, default: int) -> tuple[int, ...]:
            values = [int(v) for v in bound.get(name) or ()]
            return tuple(values * spatial if len(values) == 1 else values or [default] * spatial)

        return cls(
            tuple(int(s) for s in x.shape),
            tuple(int(s) for s in weight.shape),
            ints("stride", 1),
            ints("padding", 0),
            ints("dilation", 1),
            bool(bound.get("transposed", False)),
            int(bound.get("groups") or 1),
            x.dtype,
            ints("output_padding", 0),
        )

    def as_2d(self) -> ConvCall:
        """A 1-d convolution as ``_select_conv_backend`` runs it: viewed as 2-d with H = 1."""
        if len(self.weight_shape) != 3:
            return self
        n, c, length = self.input_shape
        return ConvCall(
            (n, c, 1, length),
            (*self.weight_shape[:2], 1, self.weight_shape[2]),
            (1, *self.stride),
            (0, *self.padding),
            (1, *self.dilation),
            self.transposed,
            self.groups,
            self.dtype,
            (0, *self.output_padding),
        )

    @property
    def kernel(self) -> tuple[int, ...]:
        return self.weight_shape[2:]

    @property
    def out_spatial(self) -> tuple[int, ...]:
        """Output size per spatial dimension (not transposed)."""
        return tuple(
            (size + 2 * pad - dil * (k - 1) - 1) // st + 1
            for size, pad, dil, k, st in zip(
                self.input_shape[2:],
                self.padding,
                self.dilation,
                self.kernel,
                self.stride,
                strict=True,
            )
        )

    @property
    def dilated(self) -> bool:
        return any(d != 1 for d in self.dilation)

    @property
    def strided(self) -> bool:
        return any(s != 1 for s in self.stride)

    @property
    def pointwise(self) -> bool:
        """A 1x1 kernel, stride 1, no padding: the slow kernels view their input."""
        return all(k == 1 for k in self.kernel) and not self.strided and not any(self.padding)


def _use_mkldnn(call: ConvCall, host: Host) -> bool:
    """``ConvParams::use_mkldnn`` for a CPU tensor."""
    if not host.mkldnn:
        return False
    if call.transposed and any(
        p >= s for p, s in zip(call.output_padding, call.stride, strict=False)
    ):
        return False
    if (call.dtype == torch.bfloat16 and host.mkldnn_bf16) or (
        call.dtype == torch.float16 and host.mkldnn_fp16
    ):
        return True
    if call.dtype != torch.float32:
        return False
    n, kh, kw = call.input_shape[0], call.weight_shape[-2], call.weight_shape[-1]
    numel = math.prod(call.input_shape[:4])
    return (call.strided or call.dilated or n >= 16 or kw != 1 or kh != 1 or host.threads > 1) and (
        call.groups > 1 or (kw > 3 and kh > 3) or n > 1 or numel > 20480
    )


def cpu_conv_backend(call: ConvCall, host: Host) -> str:
    """The ``ConvBackend`` ``_select_conv_backend`` picks for a CPU call on an x86 build
    (no XNNPACK, no NEON Winograd), by its enum name."""
    call = call.as_2d()
    if math.prod(call.input_shape) == 0:
        return "Empty"
    spatial = len(call.input_shape) - 2
    if _use_mkldnn(call, host):
        return "MkldnnTranspose" if call.transposed else "Mkldnn"
    if not call.transposed and spatial == 3 and not call.dilated:
        return "Slow3d"  # the grouped conv3d fast path
    if call.transposed:
        return f"SlowTranspose{spatial}d"
    if spatial == 2 and call.dilated:
        return "SlowDilated2d"
    if spatial == 2:
        nnpack = (
            torch._nnpack_available()
            and call.dtype == torch.float32
            and max(call.kernel) < 17
            and call.input_shape[0] >= 16
        )
        return "NnpackSpatial" if nnpack else "Slow2d"
    return "SlowDilated3d"


@dataclass(frozen=True)
class Buffer:
    """One scratch buffer a kernel holds while it runs."""

    name: str
    nbytes: int


def _columns(call: ConvCall, samples: int) -> int:
    """Bytes of ``samples`` samples' im2col columns: C_in*prod(k) x prod(out) each."""
    per_sample = call.input_shape[1] * math.prod(call.kernel) * math.prod(call.out_spatial)
    return samples * per_sample * call.dtype.itemsize


SLOW = ("Slow2d", "Slow3d", "SlowDilated2d", "SlowDilated3d")
"""The kernels whose scratch is modelled."""


def scratch(
    call: ConvCall,
    backend: str,
    passes: tuple[str, ...],
    bias_grad: bool = False,
    copy: int = 0,
) -> tuple[Buffer, ...]:
    """The buffers ``backend`` holds together at its peak inside one call: ``passes`` is
    ``("forward",)`` or the backward passes asked for (``backward_data``,
    ``backward_filter``); ``bias_grad`` whether backward also computes the bias gradient;
    ``copy`` the bytes of the contiguous copies the op makes of a strided input (forward and
    backward, ``input.contiguous(backend_memory_format)`` in ``at::_convolution`` and
    ``convolution_backward``) and ``grad_output`` (the kernels' ``grad_output.contiguous()``),
    alive with its columns. Only groups 1 for the kernels that loop over groups in
    ``at::_convolution``."""
    call = call.as_2d()
    if backend not in SLOW or (call.groups != 1 and backend != "Slow3d"):
        return ()
    held = (Buffer("contiguous_copies", copy),) if copy and passes else ()
    return held + _columns_held(call, backend, passes, bias_grad)


def _columns_held(
    call: ConvCall, backend: str, passes: tuple[str, ...], bias_grad: bool
) -> tuple[Buffer, ...]:
    batch = call.input_shape[0]
    forward = passes == ("forward",)
    data, weight = "backward_data" in passes, "backward_filter" in passes
    if backend == "Slow2d" and not call.pointwise and (forward or weight):
        return (Buffer("columns", _columns(call, batch)),)
    if backend == "Slow3d":
        viewed = call.pointwise and call.groups == 1
        if ((forward or weight) and not viewed) or data:  # fgrad_input, then columns
            return (Buffer("columns", _columns(call, batch)),)
    if backend in ("SlowDilated2d", "SlowDilated3d"):
        if forward:
            return (Buffer("columns", _columns(call, 1)),)
        if data or weight:
            out_channels = call.weight_shape[0] * call.dtype.itemsize
            bias = (Buffer("bias_sum", out_channels),) if bias_grad else ()
            return (Buffer("columns", _columns(call, 1)), *bias)
    return ()


def _suggests_channels_last(tensor: torch.Tensor) -> bool:
    """``suggest_memory_format() == ChannelsLast`` for a 4-d tensor."""
    return (
        tensor.dim() == 4
        and tensor.is_contiguous(memory_format=torch.channels_last)
        and not tensor.is_contiguous()
    )


def contiguous_copy(tensor: torch.Tensor, backend: str, x: torch.Tensor, weight) -> int:
    """Bytes of ``tensor.contiguous(format)`` where the kernel calls it: 0 for a tensor
    already laid out so. ``Slow2d`` keeps channels-last when its input or weight suggests it
    (``thnn_conv_use_channels_last``); the others want the default layout."""
    channels_last = backend == "Slow2d" and (
        _suggests_channels_last(x) or _suggests_channels_last(weight)
    )
    layout = torch.channels_last if channels_last and tensor.dim() == 4 else None
    laid_out = tensor.is_contiguous(memory_format=layout) if layout else tensor.is_contiguous()
    return 0 if laid_out else tensor.numel() * tensor.element_size()


def _recorder():
    from vramplan.trace.recorder import AllocationRecorder

    stack = _get_current_dispatch_mode_stack()
    return next((m for m in reversed(stack) if isinstance(m, AllocationRecorder)), None)


class CpuConvScratch(TorchDispatchMode):
    """Dispatch mode adding each CPU convolution kernel's scratch as a transient storage of
    the trace, taken after the op's outputs and freed at once; ``calls`` counts the forward
    convolutions per kernel."""

    def __init__(self, calls: dict[str, int], host: Host | None = None) -> None:
        super().__init__()
        self.calls = calls
        self.host = host or Host.here()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        packet = getattr(func, "overloadpacket", None)
        if packet is aten.convolution or packet is aten.convolution_backward:
            self._add_scratch(func, args, kwargs)
        return out

    def _add_scratch(self, func, args, kwargs) -> None:
        call = ConvCall.of(func, args, kwargs)
        if call is None:
            return
        backend = cpu_conv_backend(call, self.host)
        bound = bound_arguments(func, args, kwargs)
        mask = bound.get("output_mask")
        x, weight = bound["input"], bound["weight"]
        copy = contiguous_copy(x, backend, x, weight)
        if mask is None:
            passes, bias_grad = ("forward",), False
        else:
            wanted = zip(("backward_data", "backward_filter"), mask[:2], strict=True)
            passes, bias_grad = tuple(p for p, on in wanted if on), bool(mask[2])
            copy += contiguous_copy(bound["grad_output"], backend, x, weight)
        self.calls[backend] = self.calls.get(backend, 0) + (mask is None)
        buffers = scratch(call, backend, passes, bias_grad, copy)
        recorder = _recorder()
        if recorder is None or not buffers:
            return
        op = "convolution" if mask is None else "convolution_backward"
        recorder.note_scratch((b.nbytes, f"{op}:{backend}:{b.name}") for b in buffers)
