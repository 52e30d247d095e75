"""bitsandbytes' quantized linear layers, modelled on the meta device.

Each ``nn.Linear`` (but the output head, which bitsandbytes/transformers keep in full
precision) becomes a ``QuantizedLinear`` holding the tensors bitsandbytes keeps on the GPU,
with their dtypes and sizes (bitsandbytes 0.50, ``bitsandbytes/functional.py``
``quantize_4bit`` and ``int8_vectorwise_quant``; ``nn/modules.py`` ``Params4bit``,
``Int8Params``):

- **nf4 / fp4**: the weight packed two values per byte, ``uint8[(n + 1) // 2, 1]``; an
  fp32 absmax per 64-element block (``quantize_4bit``'s default ``blocksize=64``); the
  16-entry fp32 code table (``get_4bit_type``). With double quantization
  (``compress_statistics=True``) the absmax is itself quantized blockwise with
  ``blocksize=256`` after subtracting its mean: a uint8 absmax per block, an fp32 absmax
  per 256 blocks, the 256-entry fp32 dynamic code and the fp32 offset.
- **int8** (LLM.int8()): the weight as ``int8[out, in]`` (``CB``) and one fp32 scale per
  output row (``SCB``).

The forward and backward passes allocate what bitsandbytes' autograd functions do
(``autograd/_functions.py``): 4-bit ``MatMul4Bit`` dequantizes the whole weight to the
compute dtype (a transient the size of the full-precision weight; above M = 1536 rows
bitsandbytes' CUDA dispatch always takes this dequantize + ``F.linear`` path) and saves
only the quantized weight for backward, where it dequantizes again for the input gradient;
one row without gradient (``matmul_4bit``'s inference path, a decode step of one sequence)
goes through ``gemv_4bit`` instead, with no dequantized copy. Releases before 0.50
(``--bnb-version``) ran ``F.dequantize_4bit(B, quant_state).to(A.dtype)``: the weight
dequantized in the dtype it was quantized from (fp16 up to 0.42, whose ``Params4bit.cuda``
casts with ``.half()``; the loaded weight's dtype from 0.43), then copied to the compute
dtype when that differs (``dequantized_dtype``).
``MatMul8bitLt`` quantizes its input row-wise to int8 (``int8_vectorwise_quant``: int8
values and an fp32 scale per row, from an fp16 copy), multiplies into int32
(``int8_linear_matmul``), dequantizes into the input's dtype, saves the input itself, and
in backward rebuilds the weight in the input's dtype (``CB * SCB / 127``) for the input
gradient. The outlier decomposition (``threshold > 0``) is not modelled.

>>> layer = QuantizedLinear(nn.Linear(128, 256, bias=False, device="meta"), "nf4")
>>> layer.stored_bytes()  # 16,384 packed bytes, 512 fp32 absmax, 16 fp32 codes
18496
"""

from __future__ import annotations

import torch
from torch import nn

SCHEMES = ("nf4", "fp4", "int8")
BLOCKSIZE_4BIT = 64
BLOCKSIZE_ABSMAX = 256
CODE_4BIT = 16  # fp32 entries of get_4bit_type(quant_type)
CODE_DYNAMIC = 256  # fp32 entries of create_dynamic_map(), the double-quant code


def _blocks(count: int, size: int) -> int:
    return -(-count // size)


def layout_4bit(out_features: int, in_features: int, double_quant: bool) -> dict[str, tuple]:
    """Name → (shape, dtype) of the tensors bitsandbytes keeps for one 4-bit weight."""
    n = out_features * in_features
    blocks = _blocks(n, BLOCKSIZE_4BIT)
    layout = {"weight": (((n + 1) // 2, 1), torch.uint8), "code": ((CODE_4BIT,), torch.float32)}
    if double_quant:
        layout["absmax"] = ((blocks,), torch.uint8)
        layout["absmax2"] = ((_blocks(blocks, BLOCKSIZE_ABSMAX),), torch.float32)
        layout["code2"] = ((CODE_DYNAMIC,), torch.float32)
        layout["offset"] = ((), torch.float32)
    else:
        layout["absmax"] = ((blocks,), torch.float32)
    return layout


def layout_int8(out_features: int, in_features: int) -> dict[str, tuple]:
    """Name → (shape, dtype) of LLM.int8()'s stored weight: ``CB`` and ``SCB``."""
    return {
        "weight": ((out_features, in_features), torch.int8),
        "SCB": ((out_features,), torch.float32),
    }


def dequantized_dtype(version: str | None, weight_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype 4-bit ``MatMul4Bit`` of bitsandbytes ``version`` dequantizes into before
    casting to the compute dtype; None where it writes the compute dtype directly (0.50
    on, the release emulated by default).

    >>> dequantized_dtype("0.41", torch.bfloat16), dequantized_dtype("0.45", torch.bfloat16)
    (torch.float16, torch.bfloat16)
    >>> dequantized_dtype(None, torch.float16) is None
    True
    """
    if version is None:
        return None
    major, minor = (int(part) for part in version.split(".")[:2])
    if (major, minor) >= (0, 50):
        return None
    return torch.float16 if (major, minor) <= (0, 42) else weight_dtype


def _nbytes(shape: tuple, dtype: torch.dtype) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * torch.empty((), dtype=dtype).element_size()


class _Matmul4bit(torch.autograd.Function):
    """bitsandbytes' ``MatMul4Bit`` for M > 1536: dequantize, ``F.linear``, keep nothing
    but the quantized weight; backward dequantizes again."""

    @staticmethod
    def forward(ctx, x, bias, layer):
        weight = layer.dequantize()
        if weight.dtype != x.dtype:  # bitsandbytes before 0.50: ``.to(A.dtype)``
            weight = weight.to(x.dtype)
        out = nn.functional.linear(x, weight, bias)
        del weight
        ctx.layer = layer
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx, grad_output):
        grad_x = grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_bias = grad_output.sum(0, dtype=ctx.bias_dtype)
        if ctx.needs_input_grad[0]:
            weight = ctx.layer.dequantize().to(grad_output.dtype)
            grad_x = torch.matmul(grad_output, weight)
        return grad_x, grad_bias, None


class _Matmul8bit(torch.autograd.Function):
    """bitsandbytes' ``MatMul8bitLt`` (threshold 0): int8 input, int32 product, output in
    the input's dtype; the input is saved; backward rebuilds the weight."""

    @staticmethod
    def forward(ctx, x, bias, layer):
        rows = x.reshape(-1, x.shape[-1])
        half = rows.to(torch.float16)
        quantized = torch.empty(rows.shape, dtype=torch.int8, device=x.device)
        scales = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
        del half
        product = torch.empty(rows.shape[0], layer.out_features, dtype=torch.int32, device=x.device)
        out = torch.empty(rows.shape[0], layer.out_features, dtype=x.dtype, device=x.device)
        del product, quantized, scales
        if bias is not None:
            out = out.add_(bias.to(out.dtype))
        ctx.save_for_backward(x)
        ctx.layer = layer
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out.reshape(*x.shape[:-1], layer.out_features)

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_bias = grad_output.sum(0, dtype=ctx.bias_dtype)
        if ctx.needs_input_grad[0]:
            layer = ctx.layer
            weight = layer.weight.to(x.dtype, copy=True).mul_(layer.SCB.unsqueeze(1) / 127.0)
            grad_x = torch.matmul(grad_output.to(x.dtype), weight)
        return grad_x, grad_bias, None


class QuantizedLinear(nn.Linear):
    """A linear layer stored as bitsandbytes stores it (``scheme``: nf4, fp4 or int8)."""

    def __init__(
        self,
        linear: nn.Linear,
        scheme: str,
        double_quant: bool = False,
        compute_dtype: torch.dtype = torch.bfloat16,
        dequant_dtype: torch.dtype | None = None,
    ) -> None:
        nn.Module.__init__(self)
        self.dequant_dtype = dequant_dtype
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.scheme = scheme
        self.double_quant = double_quant and scheme != "int8"
        self.compute_dtype = compute_dtype
        device = linear.weight.device
        if scheme == "int8":
            layout = layout_int8(self.out_features, self.in_features)
        else:
            layout = layout_4bit(self.out_features, self.in_features, self.double_quant)
        for name, (shape, dtype) in layout.items():
            tensor = torch.empty(shape, dtype=dtype, device=device)
            if name == "weight":
                self.weight = nn.Parameter(tensor, requires_grad=False)
            else:
                self.register_buffer(name, tensor)
        self._stored_dtypes = {name: dtype for name, (_, dtype) in layout.items()}
        self.bias = linear.bias

    @property
    def logical_numel(self) -> int:
        """Elements of the full-precision weight this layer stands for."""
        return self.out_features * self.in_features

    def stored_bytes(self) -> int:
        """Bytes of the quantized weight and its statistics (the bias not included)."""
        return sum(t.numel() * t.element_size() for t in [self.weight, *self._buffers.values()])

    def _apply(self, fn, recurse=True):
        # ``model.to(torch.bfloat16)`` must not turn the fp32 statistics into bf16:
        # bitsandbytes keeps them in their own dtypes whatever the model's dtype.
        super()._apply(fn, recurse)
        for name, dtype in self._stored_dtypes.items():
            holder = self._parameters if name == "weight" else self._buffers
            tensor = holder[name]
            if tensor is not None and tensor.dtype != dtype:
                converted = tensor.to(dtype)
                holder[name] = (
                    nn.Parameter(converted, requires_grad=False) if name == "weight" else converted
                )
        return self

    def dequantize(self) -> torch.Tensor:
        """bitsandbytes' ``dequantize_4bit``: with double quantization the absmax is first
        dequantized into fp32 (``dequantize_blockwise`` + offset), then the weight is
        written in the compute dtype."""
        device = self.weight.device
        if self.double_quant:
            absmax = torch.empty(self.absmax.shape, dtype=torch.float32, device=device)
            del absmax  # freed when dequantize_4bit returns
        dtype = self.dequant_dtype or self.compute_dtype
        return torch.empty(self.out_features, self.in_features, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scheme == "int8":
            bias = self.bias
            return _Matmul8bit.apply(x, bias, self)
        # Linear4bit.forward: the input in the compute dtype, the output back in its own.
        in_dtype = x.dtype
        x = x.to(self.compute_dtype)
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        if x.numel() == x.shape[-1] and not x.requires_grad and not x.numel() % BLOCKSIZE_4BIT:
            # matmul_4bit's inference path for one row (a decode step of one sequence):
            # gemv_4bit reads the packed weight, no dequantized copy.
            out = torch.empty(*x.shape[:-1], self.out_features, dtype=x.dtype, device=x.device)
            return (out if bias is None else out.add_(bias)).to(in_dtype)
        return _Matmul4bit.apply(x, bias, self).to(in_dtype)

    def extra_repr(self) -> str:
        extra = ", double_quant" if self.double_quant else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, " + (
            f"scheme={self.scheme}{extra}, compute_dtype={self.compute_dtype}"
        )


def quantize_linears(
    model: nn.Module,
    scheme: str,
    double_quant: bool,
    compute_dtype: torch.dtype,
    skip: set[int],
    dequant_dtype: torch.dtype | None = None,
) -> int:
    """Replace every ``nn.Linear`` of ``model`` (but the modules in ``skip``, by id) with a
    ``QuantizedLinear`` (``dequant_dtype``: see ``dequantized_dtype``); returns how many
    were replaced. transformers' ``Conv1D`` (GPT-2's linear layers, weight stored ``[in,
    out]``) is quantized too, as ``_replace_with_bnb_linear`` does it
    (``transformers/integrations/bitsandbytes.py``: ``in_features, out_features =
    module.weight.shape``, the weight transposed before quantization)."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            linear = _as_linear(child)
            if linear is not None and id(child) not in skip:
                setattr(
                    parent,
                    name,
                    QuantizedLinear(linear, scheme, double_quant, compute_dtype, dequant_dtype),
                )
                replaced += 1
    return replaced


def _as_linear(module: nn.Module) -> nn.Linear | None:
    """``module`` as the ``nn.Linear`` bitsandbytes replaces: itself, a ``Conv1D``
    turned round (its bias kept), or None for anything else."""
    if type(module) is nn.Linear:
        return module
    if type(module).__name__ != "Conv1D" or not hasattr(module, "nf"):
        return None
    in_features, out_features = module.weight.shape
    linear = nn.Linear(in_features, out_features, bias=False, device=module.weight.device)
    linear.bias = module.bias
    return linear


def packed_numel_missing(model: nn.Module) -> int:
    """Elements the quantized layers stand for beyond the ones their packed weights hold
    (peft's ``get_nb_trainable_parameters`` counts a 4-bit weight twice for the same
    reason)."""
    return sum(
        m.logical_numel - m.weight.numel()
        for m in model.modules()
        if isinstance(m, QuantizedLinear)
    )
