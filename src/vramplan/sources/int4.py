"""GPTQ and AWQ int4 linear layers as GPT-QModel stores and runs them, on the meta device.

transformers 5 loads both formats through GPT-QModel (``quantizer_gptq.py``,
``integrations/awq.py``); the layouts and kernels here are GPT-QModel 7.3's
(ModelCloud/GPTQModel at f4c327a, ``gptqmodel/nn_modules/qlinear/``). Every ``nn.Linear``
but the output head becomes a ``PackedInt4Linear`` holding what the checkpoint stores:

- **GPTQ** (``GPTQQuantLinear._register_gptq_buffers``): ``qweight`` int32
  ``[ceil(in·4/32), out]`` (eight 4-bit values per int32 down the input dimension),
  ``qzeros`` int32 ``[ceil(in/g), ceil(out·4/32)]``, ``scales`` fp16 ``[ceil(in/g), out]``,
  ``g_idx`` int32 ``[in]`` (each input column's group; act-order permutes it).
- **AWQ** (``AWQuantLinear``, the GEMM format): ``qweight`` int32 ``[in, out·4/32]``
  (packed along the output dimension), ``qzeros`` int32 ``[in/g, out·4/32]``, ``scales``
  fp16 ``[in/g, out]``; no ``g_idx``.

What the kernel keeps and allocates beside them (``kernel``):

- **marlin** (``marlin.py``, ``marlin_awq.py``; GPT-QModel's automatic choice on Ampere
  and later after Hopper-only Machete): the weights repacked in place (same bytes), the
  scales in the compute dtype, GPTQ's ``qzeros`` and (without act-order) ``g_idx`` emptied,
  act-order's ``g_idx`` plus its int32 sort indices kept, and a per-layer int32 workspace of
  ``max(SMs, 128)`` entries (``utils/marlin.py`` ``marlin_make_workspace_new``). Each call
  allocates the output, an fp32 reduction buffer of ``SMs × min(ceil16(M), 64) × 256``
  entries and, with act-order, the permuted input ``[M, K]`` (``gptqmodel_ext/marlin/
  gptq_marlin.cu`` ``gptq_marlin_gemm``: ``c``, ``c_tmp``, ``a_tmp``).
- **exllamav2** (GPTQ; ``exllamav2.py``, ``utils/model.py`` ``gptqmodel_post_init``): fp16
  scales, act-order's int16 ``q_perm`` and ``q_invperm``, and one scratch buffer per device
  of the largest layer's ``in·out·2 + 128 + out·2048·8·4 + 128`` bytes (``temp_dq`` +
  ``temp_fwd`` at ``max_input_len=2048``, ``max_batch_size=8``). A call casts the input to
  fp16 and writes an fp16 output.
- **gemm** (AWQ; ``gemm_awq.py`` ``AwqGemmFn``): above ``x.shape[0] × x.shape[1] > 1024``
  the whole weight is dequantized to an fp16 ``[in, out]`` copy and multiplied; below, the
  fused GEMM writes the output alone.

The SM count is taken as 132 (an H100 SXM): the workspace and the fp32 reduction buffer
depend on it (6.75 MiB of reduction buffer on an A100's 108 SMs, 8.25 MiB on 132).

>>> linear = nn.Linear(4096, 11008, bias=False, device="meta")
>>> layer = PackedInt4Linear(linear, Int4Format("gptq"))
>>> layer.checkpoint_bytes()  # 22,544,384 packed + 176,128 zeros + 704,512 scales + 16,384 g_idx
23441408
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vramplan.errors import UserError

METHODS = ("gptq", "awq")
KERNELS = {"gptq": ("marlin", "exllamav2"), "awq": ("marlin", "gemm")}
DEFAULT_GROUP_SIZE = 128
BITS = 4
PACK_BITS = 32
SMS = 132
"""Streaming multiprocessors assumed for Marlin's workspace and reduction buffer."""
MARLIN_MAX_THREAD_N = 256
MARLIN_GROUP_SIZES = (-1, 32, 64, 128)
EXLLAMA_MAX_INPUT_LEN, EXLLAMA_MAX_BATCH = 2048, 8
AWQ_DEQUANT_ABOVE = 1024


def _ceil(count: int, size: int) -> int:
    return -(-count // size)


@dataclass(frozen=True)
class Int4Format:
    """How one int4 checkpoint is stored and run: ``method`` (gptq, awq), ``group_size``
    (-1: one group over the whole input), ``kernel``, and GPTQ's ``act_order``.

    >>> Int4Format("awq").kernel, Int4Format("gptq", kernel="exllamav2").group_size
    ('marlin', 128)
    """

    method: str
    group_size: int = DEFAULT_GROUP_SIZE
    kernel: str = "marlin"
    act_order: bool = False

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise UserError(f"unknown int4 method {self.method!r}; choose gptq or awq")
        if self.kernel not in KERNELS[self.method]:
            raise UserError(
                f"--quant-kernel {self.kernel}: {self.method} runs on "
                + " or ".join(KERNELS[self.method])
            )
        size = self.group_size
        if isinstance(size, bool) or not isinstance(size, int) or (size <= 0 and size != -1):
            raise UserError(f"--group-size must be a positive integer or -1, got {size}")
        if self.kernel == "marlin" and size not in MARLIN_GROUP_SIZES:
            raise UserError(f"--group-size {size}: Marlin takes -1, 32, 64 or 128")
        if self.act_order and self.method != "gptq":
            raise UserError("--act-order is GPTQ's (desc_act); AWQ has no act-order")

    def groups(self, in_features: int) -> int:
        """Quantization groups along the input dimension."""
        size = in_features if self.group_size == -1 else self.group_size
        if self.method == "awq":
            if in_features % size:
                raise UserError(
                    f"awq: an input of {in_features} features does not split into groups "
                    f"of {size} (--group-size)"
                )
            return in_features // size
        return _ceil(in_features, size)


def checkpoint_layout(fmt: Int4Format, out_features: int, in_features: int) -> dict[str, tuple]:
    """Name → (shape, dtype) of the tensors the checkpoint stores for one linear (the
    bias aside), as GPT-QModel registers them.

    >>> checkpoint_layout(Int4Format("awq"), 512, 256)["qweight"]
    ((256, 64), torch.int32)
    """
    groups = fmt.groups(in_features)
    packed_out = _ceil(out_features * BITS, PACK_BITS)
    if fmt.method == "awq":
        if out_features % (PACK_BITS // BITS):
            raise UserError(f"awq packs 8 outputs per int32; {out_features} outputs do not")
        return {
            "qweight": ((in_features, packed_out), torch.int32),
            "qzeros": ((groups, packed_out), torch.int32),
            "scales": ((groups, out_features), torch.float16),
        }
    return {
        "qweight": ((_ceil(in_features * BITS, PACK_BITS), out_features), torch.int32),
        "qzeros": ((groups, packed_out), torch.int32),
        "scales": ((groups, out_features), torch.float16),
        "g_idx": ((in_features,), torch.int32),
    }


def resident_layout(
    fmt: Int4Format, out_features: int, in_features: int, compute_dtype: torch.dtype
) -> dict[str, tuple]:
    """Name → (shape, dtype) of what stays on the GPU once the kernel's ``post_init`` ran
    (the shared exllamav2 scratch aside)."""
    layout = checkpoint_layout(fmt, out_features, in_features)
    scales_shape = layout["scales"][0]
    if fmt.kernel == "exllamav2":
        if fmt.act_order:
            layout["q_perm"] = ((in_features,), torch.int16)
            layout["q_invperm"] = ((in_features,), torch.int16)
        return layout
    layout["scales"] = (scales_shape, compute_dtype)
    if fmt.kernel == "marlin":
        layout["workspace"] = ((max(SMS, 128),), torch.int32)
        if fmt.method == "gptq":
            layout["qzeros"] = ((0,), torch.int32)
            if fmt.act_order:
                layout["g_idx_sort_indices"] = ((in_features,), torch.int32)
            else:
                layout["g_idx"] = ((0,), torch.int32)
    return layout


def exllamav2_scratch_bytes(out_features: int, in_features: int) -> int:
    """``scratch_space_fixed()`` of one exllamav2 layer (``temp_dq`` + ``temp_fwd``).

    >>> exllamav2_scratch_bytes(4096, 4096)
    301990144
    """
    temp_dq = in_features * out_features * 2 + 128
    temp_fwd = out_features * EXLLAMA_MAX_INPUT_LEN * EXLLAMA_MAX_BATCH * 4 + 128
    return temp_dq + temp_fwd


def _numel(shape: tuple) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


class PackedInt4Linear(nn.Module):
    """A linear layer stored as a GPTQ or AWQ checkpoint and run by ``fmt.kernel``
    (inference only: these kernels train nothing here)."""

    def __init__(
        self, linear: nn.Linear, fmt: Int4Format, compute_dtype: torch.dtype = torch.float16
    ) -> None:
        super().__init__()
        self.fmt = fmt
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.compute_dtype = compute_dtype
        device = linear.weight.device
        layout = resident_layout(self.fmt, self.out_features, self.in_features, compute_dtype)
        self._stored_dtypes = {name: dtype for name, (_, dtype) in layout.items()}
        for name, (shape, dtype) in layout.items():
            tensor = torch.empty(shape, dtype=dtype, device=device)
            if name in ("workspace", "g_idx_sort_indices", "q_perm", "q_invperm"):
                self.register_buffer(name, tensor)
            else:  # GPT-QModel's Marlin registers these as frozen parameters
                self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
        self.bias = None
        if linear.bias is not None:
            bias = torch.empty(self.out_features, dtype=torch.float16, device=device)
            self.bias = nn.Parameter(bias, requires_grad=False)
            self._stored_dtypes["bias"] = torch.float16

    @property
    def logical_numel(self) -> int:
        """Elements of the full-precision weight this layer stands for."""
        return self.out_features * self.in_features

    def checkpoint_bytes(self) -> int:
        """Bytes of the packed weight, zeros, scales and ``g_idx`` as the checkpoint holds
        them (the bias not included)."""
        layout = checkpoint_layout(self.fmt, self.out_features, self.in_features)
        return sum(_numel(shape) * dtype.itemsize for shape, dtype in layout.values())

    def _apply(self, fn, recurse=True):
        # ``model.to(torch.bfloat16)`` must leave the packed int32 words and the kernel's
        # dtypes alone (GPT-QModel keeps them whatever the model's dtype).
        super()._apply(fn, recurse)
        for name, dtype in self._stored_dtypes.items():
            holder = self._parameters if name in self._parameters else self._buffers
            tensor = holder.get(name)
            if tensor is not None and tensor.dtype != dtype:
                converted = tensor.to(dtype)
                holder[name] = (
                    nn.Parameter(converted, requires_grad=False)
                    if name in self._parameters
                    else converted
                )
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            raise UserError("gptq/awq layers are modelled for inference (--mode infer|generate)")
        kernel = self.fmt.kernel
        if kernel == "marlin":
            return self._marlin(x)
        if kernel == "exllamav2":
            return self._exllamav2(x)
        return self._awq_gemm(x)

    def _bias(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def _marlin(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        m = rows.shape[0]
        out = torch.empty(m, self.out_features, dtype=x.dtype, device=x.device)  # bias inside
        block = min(_ceil(m, 16) * 16, 64)
        reduce = torch.empty(SMS * block * MARLIN_MAX_THREAD_N, dtype=torch.float32)
        permuted = torch.empty(m, self.in_features, dtype=x.dtype) if self.fmt.act_order else None
        del reduce, permuted  # the kernel's temporaries, freed as gptq_marlin_gemm returns
        return out.reshape(*x.shape[:-1], self.out_features)

    def _exllamav2(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        x = x.to(torch.float16)
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float16, device=x.device)
        if self.bias is not None:
            out.add_(self.bias)
        return out.reshape(*x.shape[:-1], self.out_features).to(in_dtype)

    def _awq_gemm(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        compute = in_dtype if in_dtype in (torch.float16, torch.bfloat16) else torch.float16
        x = x.to(compute).contiguous()
        if x.dim() > 1 and x.shape[0] * x.shape[1] > AWQ_DEQUANT_ABOVE:
            weight = torch.empty(self.in_features, self.out_features, dtype=torch.float16)
            out = torch.matmul(x, weight.to(compute))
            del weight
        else:
            rows = x.reshape(-1, x.shape[-1])
            out = torch.empty(rows.shape[0], self.out_features, dtype=compute, device=x.device)
        out = self._bias(out).reshape(*x.shape[:-1], self.out_features)
        return out.to(in_dtype)

    def extra_repr(self) -> str:
        fmt = self.fmt
        order = ", act_order" if fmt.act_order else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{fmt.method} g={fmt.group_size}, kernel={fmt.kernel}{order}"
        )


def quantize_int4_linears(
    model: nn.Module, fmt: Int4Format, compute_dtype: torch.dtype, skip: set[int]
) -> int:
    """Replace every ``nn.Linear`` of ``model`` (but the modules in ``skip``, by id) with a
    ``PackedInt4Linear``; with exllamav2, the model gets the shared scratch buffer
    (``exllamav2_scratch``). Returns how many layers were replaced."""
    replaced = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and id(child) not in skip:
                layer = PackedInt4Linear(child, fmt, compute_dtype)
                setattr(parent, name, layer)
                replaced.append(layer)
    if replaced and fmt.kernel == "exllamav2":
        scratch = max(exllamav2_scratch_bytes(q.out_features, q.in_features) for q in replaced)
        device = replaced[0].qweight.device
        buffer = torch.empty(scratch // 2, dtype=torch.float16, device=device)
        model.register_buffer("exllamav2_scratch", buffer)
    return len(replaced)
