"""What a serving engine reserves on one GPU, and the KV cache that is left: vLLM's
start-up accounting, emulated.

vLLM (V1 engine, 0.10–0.11; ``data/serving.json`` cites the code) loads the weights,
runs ``profile_run`` — one forward over ``max_num_batched_tokens`` tokens and a dummy
sampling of ``max_num_seqs`` sequences — and gives the KV cache what is left of
``total × gpu_memory_utilization`` after the weights, the peak of that run, and the
memory outside PyTorch. Here the weights are the model's parameter bytes per rank, the
profile run is traced (the forward through transformers, the sampler through the ops
vLLM's ``Sampler`` runs), and the KV cache is paged in blocks::

    >>> kv_bytes_per_token(layers=32, kv_heads=8, head_dim=128, dtype_bytes=2)
    131072
    >>> paged_tokens(10 * 2**30, per_token=131072, block_size=16)
    81920
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from functools import cache
from importlib import resources
from typing import Any

import torch
from torch import nn

from vramplan.device.catalog import GpuSpec
from vramplan.device.options import DeviceOptions
from vramplan.device.runtime import driver_reserved_bytes
from vramplan.errors import UserError
from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe
from vramplan.result import Component
from vramplan.sources.base import BuiltModel
from vramplan.trace.materialize import unique_parameters

ENGINES = ("vllm",)
KV_CACHE_DTYPES = {"auto": None, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@cache
def serving_table() -> dict:
    """``data/serving.json``: each engine's defaults and measured figures."""
    return json.loads((resources.files("vramplan") / "data" / "serving.json").read_text())


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Keys and values of one token in every layer."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def paged_tokens(budget: int, per_token: int, block_size: int) -> int:
    """Tokens a budget holds in whole blocks of ``block_size`` tokens (vLLM:
    ``num_blocks = available // page_size``)."""
    if budget <= 0:
        return 0
    return (budget // (per_token * block_size)) * block_size


@dataclass(frozen=True)
class ServeOptions:
    """The engine's start-up flags (None: the engine's default for the card)."""

    engine: str = "vllm"
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    tp: int = 1
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise UserError(f"unknown engine {self.engine!r}; choose one of: {', '.join(ENGINES)}")
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise UserError(f"--gpu-memory-utilization must be in (0, 1], got {util}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise UserError(f"--{name.replace('_', '-')} must be a positive integer")
        for name in ("tp", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UserError(f"--{name.replace('_', '-')} must be a positive integer")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise UserError(
                f"unknown --kv-cache-dtype {self.kv_cache_dtype!r}; choose one of: "
                + ", ".join(KV_CACHE_DTYPES)
            )
        if self.dtype not in DTYPES:
            raise UserError(
                f"--precision {self.dtype}: the engine serves half-precision weights; "
                "choose bf16 or fp16"
            )


@dataclass(frozen=True)
class ServingPlan:
    """What the engine reserves on one rank, and the KV cache left (bytes)."""

    model: str
    gpu: str
    engine_version: str
    options: ServeOptions
    total_bytes: int
    """``torch.cuda.mem_get_info`` total: the card less the driver's reserve."""
    requested_bytes: int
    weights_bytes: int
    activation_peak_bytes: int
    non_torch_bytes: int
    cuda_graph_bytes: int
    kv_bytes_per_token: int
    kv_cache_bytes: int
    kv_tokens: int
    max_model_len: int
    max_concurrency: float
    """Sequences of ``max_model_len`` tokens the cache holds at once."""
    largest_model_len: int
    """The longest ``--max-model-len`` whose one sequence fits the cache (the model's
    position limit caps it)."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def fits(self) -> bool:
        """Whether the engine starts: one sequence of ``max_model_len`` fits the cache."""
        return self.kv_tokens >= self.max_model_len

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": "vramplan.serve/1",
            "model": self.model,
            "gpu": self.gpu,
            "engine": self.options.engine,
            "engine_version": self.engine_version,
            "options": {
                "gpu_memory_utilization": self.options.gpu_memory_utilization,
                "max_model_len": self.max_model_len,
                "tp": self.options.tp,
                "max_num_seqs": self.options.max_num_seqs,
                "max_num_batched_tokens": self.options.max_num_batched_tokens,
                "kv_cache_dtype": self.options.kv_cache_dtype,
                "block_size": self.options.block_size,
                "dtype": self.options.dtype,
            },
            "total_bytes": self.total_bytes,
            "requested_bytes": self.requested_bytes,
            "weights_bytes": self.weights_bytes,
            "activation_peak_bytes": self.activation_peak_bytes,
            "non_torch_bytes": self.non_torch_bytes,
            "cuda_graph_bytes": self.cuda_graph_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_cache_bytes": self.kv_cache_bytes,
            "kv_tokens": self.kv_tokens,
            "max_concurrency": round(self.max_concurrency, 2),
            "largest_max_model_len": self.largest_model_len,
            "fits": self.fits,
            "notes": list(self.notes),
        }


def with_defaults(options: ServeOptions, gpu: GpuSpec, model_len: int) -> ServeOptions:
    """The options with the engine's defaults for ``gpu`` filled in (``vllm serve``)."""
    defaults = serving_table()[options.engine]["defaults"]
    tier = defaults["large" if gpu.total_bytes >= defaults["large_gpu_bytes"] else "other"]
    if "a100" in gpu.name.lower():
        tier = defaults["other"]
    return ServeOptions(
        **{
            **options.__dict__,
            "max_model_len": options.max_model_len or model_len,
            "max_num_seqs": options.max_num_seqs or tier["max_num_seqs"],
            "max_num_batched_tokens": options.max_num_batched_tokens
            or tier["max_num_batched_tokens"],
        }
    )


def weights_per_rank(model: nn.Module, tp: int) -> int:
    """Parameter bytes on one rank: matrices (linear layers, embeddings) split over the
    tensor-parallel ranks, vectors (norms) replicated."""
    total = 0
    for param in unique_parameters(model):
        nbytes = param.numel() * param.element_size()
        total += -(-nbytes // tp) if param.dim() >= 2 else nbytes
    return total


def _kv_shape(config: Any) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a transformers decoder config."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layers = getattr(text, "num_hidden_layers", None)
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else None)
    if not (layers and kv_heads and head_dim):
        raise UserError("serve: the model's config has no layers / heads to size a KV cache by")
    return int(layers), int(kv_heads), int(head_dim)


def sample_like_vllm(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The tensor ops of vLLM V1's ``Sampler`` on its profiling batch (random sampling
    with temperature, top-k and top-p; ``vllm/v1/sample/ops/topk_topp_sampler.py``)."""
    logits = logits.to(torch.float32)
    rows, vocab = logits.shape
    temperatures = torch.full((rows,), temperature)
    greedy = logits.argmax(dim=-1)
    logits.div_(temperatures.unsqueeze(dim=1))
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    top_k = torch.full((rows,), vocab - 1, dtype=torch.long)
    top_k_mask = logits_sort.gather(1, (vocab - top_k).unsqueeze(dim=1))
    top_k_mask = logits_sort < top_k_mask
    logits_sort.masked_fill_(top_k_mask, -float("inf"))
    probs_sort = logits_sort.softmax(dim=-1)
    probs_sum = torch.cumsum(probs_sort, dim=-1, out=probs_sort)
    top_p_mask = probs_sum <= 1 - top_p
    top_p_mask[:, -1] = False
    logits_sort.masked_fill_(top_p_mask, -float("inf"))
    logits = logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    q = torch.empty_like(probs).exponential_()
    return torch.where(temperatures < 1e-5, greedy, probs.div_(q).argmax(dim=-1))


def profile_run_peak(built: BuiltModel, options: ServeOptions, device: DeviceOptions) -> int:
    """The peak of vLLM's ``profile_run`` above the weights: a forward over
    ``max_num_batched_tokens`` tokens as ``min(max_num_seqs, tokens)`` sequences of equal
    length (``_dummy_run``'s split), the last position's logits of each, and the dummy
    sampling of them (allocated bytes, as ``torch.cuda.max_memory_allocated``
    counts them, on the card)."""
    tokens = options.max_num_batched_tokens
    rows = min(options.max_num_seqs, tokens)
    sampler = serving_table()[options.engine]["sampler"]
    generator = built.generator

    def make_batch(_batch_size: int, _dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(rows, tokens // rows, dtype=torch.long)

    def run(model: nn.Module, ids: torch.Tensor, _training: bool) -> torch.Tensor:
        kwargs = {"logits_to_keep": 1} if generator.keeps_last_logits else {}
        with built.forward_context():
            output = model(input_ids=ids, use_cache=False, **kwargs)
        logits = output.logits[:, -1]
        del output
        return sample_like_vllm(logits, sampler["temperature"], sampler["top_p"])

    profile = replace(built, make_batch=make_batch, run=run, notes=list(built.notes))
    recipe = Recipe(batch_size=rows, seq_len=tokens // rows, precision=options.dtype, mode="infer")
    estimate = estimate_built(profile, recipe, "cuda", device)
    resident = estimate.components[Component.PARAMETERS] + estimate.components[Component.BUFFERS]
    return estimate.peak.allocated_bytes - resident


def plan_serving(built: BuiltModel, options: ServeOptions, device: DeviceOptions) -> ServingPlan:
    """vLLM's start-up accounting for ``built`` on ``device``'s card."""
    if built.generator is None or built.generator.encoder_decoder:
        raise UserError(f"serve: {built.name} is not a causal language model vLLM would serve")
    gpu = device.card
    table = serving_table()[options.engine]
    config = built.model.config
    text = config.get_text_config()  # a vision-language model's positions are its text stack's
    model_len = int(getattr(text, "max_position_embeddings", 0) or 0) or 4096
    options = with_defaults(options, gpu, model_len)
    layers, kv_heads, head_dim = _kv_shape(config)
    if options.tp > 1 and kv_heads % options.tp and options.tp % kv_heads:
        raise UserError(f"--tp {options.tp} does not divide the model's {kv_heads} KV heads")
    dtype_bytes = KV_CACHE_DTYPES[options.kv_cache_dtype] or DTYPES[options.dtype].itemsize
    per_token = kv_bytes_per_token(layers, max(1, kv_heads // options.tp), head_dim, dtype_bytes)
    total = gpu.total_bytes - driver_reserved_bytes(gpu)
    requested = int(total * options.gpu_memory_utilization)
    weights = weights_per_rank(built.model.to(DTYPES[options.dtype]), options.tp)
    activation = profile_run_peak(built, options, device)
    non_torch = table["non_torch_bytes"]["tensor_parallel" if options.tp > 1 else "single"]
    budget = requested - weights - activation - non_torch
    tokens = paged_tokens(budget, per_token, options.block_size)
    notes = [
        f"emulates {table['version']}: KV cache = total × gpu_memory_utilization − weights − "
        "profile-run peak − memory outside PyTorch",
        f"profile run: {options.max_num_batched_tokens} tokens, "
        f"{min(options.max_num_seqs, options.max_num_batched_tokens)} sampled sequences "
        "(the forward traced through transformers' implementation, the sampler through "
        "vLLM's sampling ops)",
        f"CUDA graphs (about {table['cuda_graph_bytes']['typical'] / 2**30:.1f} GiB, measured "
        "by others) are captured after the KV cache, in the share above the utilization line",
    ]
    if options.tp > 1:
        notes.append(
            f"tensor parallel {options.tp}: weights and KV heads per rank; the profile run's "
            "peak is traced unsplit (the sampler's logits are whole on every rank)"
        )
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        notes.append("sliding-window layers are counted as full attention")
    spare = total - requested
    if spare < table["cuda_graph_bytes"]["typical"]:
        notes.append("little room above the utilization line for CUDA graphs")
    return ServingPlan(
        model=built.name,
        gpu=gpu.name,
        engine_version=table["version"],
        options=options,
        total_bytes=total,
        requested_bytes=requested,
        weights_bytes=weights,
        activation_peak_bytes=activation,
        non_torch_bytes=non_torch,
        cuda_graph_bytes=table["cuda_graph_bytes"]["typical"],
        kv_bytes_per_token=per_token,
        kv_cache_bytes=max(budget, 0),
        kv_tokens=tokens,
        max_model_len=options.max_model_len,
        max_concurrency=tokens / options.max_model_len,
        largest_model_len=min(tokens, model_len),
        notes=tuple(notes),
    )
