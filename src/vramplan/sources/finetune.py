"""Fine-tuning as people run it: quantized base weights, LoRA through the real ``peft``,
and frozen parameters, applied to a built (meta) model before it is traced.

The order is the one of a QLoRA script: the base model is loaded quantized
(``BitsAndBytesConfig``; here ``sources/quantized.py`` models bitsandbytes' layouts), then
wrapped with ``get_peft_model(model, LoraConfig(...))``, which freezes every base weight and
adds trainable adapters; ``--freeze`` / ``--train-only`` then freeze by parameter name::

    built = apply_finetune(resolve("hf:llama-2-7b", recipe), Recipe(lora_rank=8))
    sum(p.numel() for p in built.model.parameters() if p.requires_grad)   # 4,194,304

Frozen parameters get no gradient (autograd skips them) and no optimizer state (only
trainable parameters reach the optimizer), so the traced step shows exactly that.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator
from fnmatch import fnmatchcase

import torch
from torch import nn

from vramplan.errors import UserError
from vramplan.recipe import Recipe
from vramplan.sources.base import BuiltModel
from vramplan.sources.fp8_weights import quantize_fp8_linears
from vramplan.sources.hf_attention import repeat_kv_note
from vramplan.sources.int4 import DEFAULT_GROUP_SIZE, Int4Format, quantize_int4_linears
from vramplan.sources.loss import loss_run
from vramplan.sources.quantized import dequantized_dtype, quantize_linears
from vramplan.sources.training_cache import keep_training_cache

_TASK_TYPES = {
    "causal-lm": "CAUSAL_LM",
    "seq2seq": "SEQ_2_SEQ_LM",
    "sequence-classification": "SEQ_CLS",
}
_COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

_WEIGHT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def wants_finetune(recipe: Recipe) -> bool:
    """Whether the recipe asks for any of LoRA, quantized weights or frozen parameters."""
    return bool(recipe.lora_rank or recipe.quantize != "none" or recipe.freeze or recipe.train_only)


def patterns(text: str | None) -> list[str]:
    """Comma-separated fnmatch patterns (``"*.embed_tokens.*,lm_head.*"``)."""
    return [p.strip() for p in (text or "").split(",") if p.strip()]


def compute_dtype_for(recipe: Recipe) -> torch.dtype:
    """``--compute-dtype``, else the recipe's half-precision dtype, else bf16 (QLoRA's)."""
    if recipe.compute_dtype:
        return _COMPUTE_DTYPES[recipe.compute_dtype]
    return torch.float16 if recipe.compute_dtype_name == "float16" else torch.bfloat16


def _output_head(model: nn.Module) -> set[int]:
    """The output embedding (``get_output_embeddings``) and any module named ``lm_head``."""
    skip = set()
    get_output = getattr(model, "get_output_embeddings", None)
    head = get_output() if callable(get_output) else None
    if head is not None:
        skip.add(id(head))
    for name, module in model.named_modules():
        if name.split(".")[-1] == "lm_head":
            skip.add(id(module))
    return skip


def kept_unquantized(model: nn.Module) -> set[int]:
    """The modules transformers' bitsandbytes and FP8 quantizers leave as they are, by
    transformers' own rule (``HfQuantizer.get_modules_to_not_convert`` with the class's
    ``_keep_in_fp32_modules``, matched by ``should_convert_module``, transformers 5
    ``quantizers/``): tied weights, the output embedding, the last parameter's name less
    ``.weight`` (a classifier with a bias is quantized: its last parameter is the bias),
    and T5's ``wo``. Before transformers 5, the output head (``_output_head``)."""
    try:
        from transformers.quantizers.base import HfQuantizer
        from transformers.quantizers.quantizers_utils import should_convert_module
    except ImportError:
        return _output_head(model)
    keys = HfQuantizer.get_modules_to_not_convert(model, None, model._keep_in_fp32_modules)
    return {id(m) for name, m in model.named_modules() if not should_convert_module(name, keys)}


def _is_transformers_model(model: nn.Module) -> bool:
    return any(cls.__name__ == "PreTrainedModel" for cls in type(model).__mro__)


@contextlib.contextmanager
def _bitsandbytes_hidden() -> Iterator[None]:
    """Within it, ``import bitsandbytes`` fails and ``importlib.util.find_spec`` finds no
    bitsandbytes (a ``None`` entry in ``sys.modules``), unless it is imported already;
    after it, peft's cached answers to whether bitsandbytes is installed are forgotten, so
    that a user's own peft in the same process (a notebook) finds it again.

    peft imports bitsandbytes when it is installed, to wrap its quantized layers
    (``peft.import_utils.is_bnb_available``). The models traced here hold none: their
    quantized layers are ``sources/quantized.py``'s, subclasses of ``nn.Linear`` that peft
    wraps as it wraps any linear layer. The import costs over a second (bitsandbytes
    compiles its CPU kernels with ``torch.compile``, which imports inductor) and logs a
    warning about optional CPU kernels on a machine without them.

    >>> imported = "bitsandbytes" in sys.modules
    >>> with _bitsandbytes_hidden():
    ...     hidden = imported or sys.modules["bitsandbytes"] is None
    >>> hidden, ("bitsandbytes" in sys.modules) == imported
    (True, True)
    """
    if "bitsandbytes" in sys.modules:
        yield
        return
    sys.modules["bitsandbytes"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if sys.modules.get("bitsandbytes", "") is None:
            del sys.modules["bitsandbytes"]
        answers = sys.modules.get("peft.import_utils")
        for name in ("is_bnb_available", "is_bnb_4bit_available"):
            getattr(getattr(answers, name, None), "cache_clear", lambda: None)()


def _peft():
    try:
        import peft
    except ImportError:
        raise UserError("peft is not installed: pip install 'vramplan[finetune]'") from None
    return peft


def lora_config(recipe: Recipe, kind: str):
    """peft's ``LoraConfig`` for the recipe (peft's defaults where the recipe is silent:
    its per-architecture target modules, ``lora_alpha=8``)."""
    peft = _peft()
    targets = recipe.lora_targets
    if targets is not None and targets.strip().lower() != "all-linear":
        targets = patterns(targets)
    elif targets is not None:
        targets = "all-linear"
    options = {"r": recipe.lora_rank, "lora_dropout": recipe.lora_dropout}
    if recipe.dora:
        options["use_dora"] = True
    if recipe.lora_alpha is not None:
        options["lora_alpha"] = recipe.lora_alpha
    task = _TASK_TYPES.get(kind)
    if task is not None:
        options["task_type"] = task
    return peft.LoraConfig(target_modules=targets, **options)


def wrap_lora(model: nn.Module, recipe: Recipe, kind: str) -> nn.Module:
    """``get_peft_model(model, LoraConfig(...))``, as users write it. A model on the meta
    device gets its adapters made there: peft creates them on the default device (the host),
    initialises them and only then moves them to their layer's device, which for the 560
    adapters of a 70B model is 0.8 GB of host memory and a second of random numbers.

    >>> from vramplan.recipe import Recipe
    >>> with torch.device("meta"):
    ...     model = nn.Sequential(nn.Linear(64, 64))
    >>> wrapped = wrap_lora(model, Recipe(lora_rank=4, lora_targets="0"), "")
    >>> sorted({p.device.type for p in wrapped.parameters()})
    ['meta']
    """
    on_meta = all(p.is_meta for p in model.parameters())
    made_on = torch.device("meta") if on_meta else contextlib.nullcontext()
    try:
        with _bitsandbytes_hidden():
            peft = _peft()
            config = lora_config(recipe, kind)
            with warnings.catch_warnings(), made_on:  # (peft's fan_in_fan_out notice, renames)
                warnings.simplefilter("ignore")
                return peft.get_peft_model(model, config)
    except (ValueError, TypeError, KeyError) as exc:
        hint = ""
        if recipe.lora_targets is None:  # peft's own defaults found nothing to wrap
            model_type = getattr(getattr(model, "config", None), "model_type", None)
            hint = (
                f" (peft's default targets for {model_type or 'this model'} found none: "
                "pass --lora-targets, e.g. all-linear or q_proj,v_proj)"
            )
        raise UserError(f"peft cannot add LoRA adapters: {exc}{hint}") from None


def apply_freezing(model: nn.Module, freeze: str | None, train_only: str | None) -> None:
    """``--train-only``: only parameters matching a pattern train; ``--freeze``: those
    matching a pattern do not. Patterns are fnmatch patterns over parameter names."""
    named = list(model.named_parameters())
    for option, text in (("--train-only", train_only), ("--freeze", freeze)):
        for pattern in patterns(text):
            if not any(fnmatchcase(name, pattern) for name, _ in named):
                example = named[0][0] if named else "(none)"
                raise UserError(
                    f"{option} {pattern!r} matches no parameter name (names look like {example!r})"
                )
    if train_only:
        keep = patterns(train_only)
        for name, param in named:
            param.requires_grad_(any(fnmatchcase(name, p) for p in keep))
    for name, param in named:
        if any(fnmatchcase(name, p) for p in patterns(freeze)):
            param.requires_grad_(False)


def apply_finetune(built: BuiltModel, recipe: Recipe, device: str = "meta") -> BuiltModel:
    """The built model quantized, LoRA-wrapped and frozen as the recipe says, with the loss
    and packing the recipe asks for (unchanged when it says nothing)."""
    apply_loss_and_packing(built, recipe)
    keep_training_cache(built, recipe)
    if note := repeat_kv_note(built.model, recipe):
        built.notes.append(note)
    if not wants_finetune(recipe):
        return built
    model = built.model
    notes = list(built.notes)
    if recipe.quantize in ("gptq", "awq"):
        if device != "meta":
            raise UserError("--quantize is modelled on the meta device only; it cannot be run")
        notes.append(_quantize_int4(model, recipe, built.name))
    elif recipe.quantize != "none" and not _is_transformers_model(model):
        raise UserError(
            f"--quantize {recipe.quantize} is transformers' quantization_config at "
            f"from_pretrained; {built.name} is not a transformers model"
        )
    elif recipe.quantize == "fp8":
        if device != "meta":
            raise UserError("--quantize is modelled on the meta device only; it cannot be run")
        if quantize_fp8_linears(model, kept_unquantized(model)) == 0:
            raise UserError(f"--quantize fp8: {built.name} has no linear layer to quantize")
        notes.append(
            "quantized fp8: every linear but the output head as transformers' fine-grained "
            "FP8 (e4m3 weights, fp32 scales per 128 x 128 block; fused activation "
            "quantization in the matmul)"
        )
    elif recipe.quantize != "none":
        if device != "meta":
            raise UserError("--quantize is modelled on the meta device only; it cannot be run")
        dtype = compute_dtype_for(recipe)
        count = quantize_linears(
            model,
            recipe.quantize,
            recipe.double_quant,
            dtype,
            kept_unquantized(model),
            dequantized_dtype(recipe.bnb_version, _WEIGHT_DTYPES[recipe.param_dtype_name]),
        )
        if count == 0:
            raise UserError(
                f"--quantize {recipe.quantize}: {built.name} has no linear layer to quantize"
            )
        stats = "double-quantized absmax" if recipe.double_quant else "fp32 absmax per 64"
        layout = (
            "int8 weights, fp32 row scales"
            if recipe.quantize == "int8"
            else f"packed 4-bit weights, {stats}"
        )
        notes.append(
            f"quantized {recipe.quantize}: {count} linear layers ({layout}; the output head "
            "and the modules transformers keeps left as they are), "
            f"computing in {str(dtype).removeprefix('torch.')}: bitsandbytes' layouts modelled, "
            "not bitsandbytes itself"
        )
        notes.extend(_unreached_experts(model, recipe.quantize))
    if recipe.lora_rank:
        model = wrap_lora(model, recipe, built.kind)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        kind = "DoRA (peft use_dora: a magnitude vector per layer)" if recipe.dora else "LoRA"
        notes.append(
            f"{kind} r={recipe.lora_rank} through peft on {_target_names(model)}: "
            f"{trainable:,} trainable parameters, base weights frozen"
        )
    if recipe.freeze or recipe.train_only:
        apply_freezing(model, recipe.freeze, recipe.train_only)
    if recipe.is_training and not any(p.requires_grad for p in model.parameters()):
        raise UserError("no parameter is left to train: loosen --freeze / --train-only")
    built.model = model
    built.notes = notes
    return built


def _unreached_experts(model: nn.Module, scheme: str) -> list[str]:
    """A note when expert weights stay unquantized: transformers 5 holds a mixture of
    experts' weights as 3-D parameters, which ``replace_with_bnb_linear`` (``nn.Linear``
    and ``Conv1D`` only) does not reach. A convolution's weight (a vision tower's patch
    embedding) has 3 or more dimensions too and is not an expert's."""
    kept = sum(
        p.numel()
        for module in model.modules()
        if not isinstance(module, nn.modules.conv._ConvNd)
        for p in module.parameters(recurse=False)
        if p.dim() >= 3
    )
    if not kept:
        return []
    return [
        f"--quantize {scheme} leaves {kept:,} expert weights unquantized: transformers 5 holds "
        "them as 3-D parameters, which bitsandbytes' linear replacement does not reach "
        "(--experts linear: transformers 4.x's per-expert linears, quantized)"
    ]


def _quantize_int4(model: nn.Module, recipe: Recipe, name: str) -> str:
    """Replace the linears with GPTQ/AWQ int4 layers (``sources/int4.py``); the note."""
    fmt = Int4Format(
        recipe.quantize,
        group_size=recipe.group_size or DEFAULT_GROUP_SIZE,
        kernel=recipe.quant_kernel or "marlin",
        act_order=recipe.act_order,
    )
    dtype = compute_dtype_for(recipe)
    count = quantize_int4_linears(model, fmt, dtype, _output_head(model))
    if count == 0:
        raise UserError(f"--quantize {recipe.quantize}: {name} has no linear layer")
    order = ", act-order" if fmt.act_order else ""
    return (
        f"quantized {fmt.method} int4: {count} linear layers (packed int32 weights and zeros, "
        f"fp16 scales per {fmt.group_size} inputs{order}; output head kept), run by "
        f"GPT-QModel's {fmt.kernel} kernel in {str(dtype).removeprefix('torch.')}: the "
        "layouts and kernel buffers modelled, not the kernels themselves"
    )


def _target_names(model: nn.Module) -> str:
    config = next(iter(getattr(model, "peft_config", {}).values()), None)
    targets = getattr(config, "target_modules", None)
    if isinstance(targets, (set, list, tuple)):
        return ", ".join(sorted(targets))
    return str(targets)


def apply_loss_and_packing(built: BuiltModel, recipe: Recipe) -> None:
    """``--loss-chunks`` / ``--fused-ce`` replace a causal LM's loss (``sources/loss.py``);
    ``--packing`` is noted: the batch is already ``batch x seq-len`` real tokens."""
    if recipe.loss_shift_copy and not (recipe.loss_chunks or recipe.fused_ce):
        if built.kind != "causal-lm":
            raise UserError(
                f"--loss-shift-copy is a causal LM's loss; {built.name} is {built.kind}"
            )
        built.run = loss_run(recipe, built.forward_context)
        built.notes.append(
            "loss: the model's own pre-4.49 CrossEntropyLoss (a contiguous copy of the "
            "shifted logits in their own dtype, no fp32 upcast)"
            if recipe.loss_no_upcast
            else "loss: transformers < 4.49's ForCausalLMLoss (fp32 logits, then a contiguous "
            "fp32 copy of the shifted logits)"
        )
    if recipe.loss_chunks or recipe.fused_ce:
        flag = "--fused-ce" if recipe.fused_ce else f"--loss-chunks {recipe.loss_chunks}"
        if built.kind != "causal-lm":
            raise UserError(f"{flag} replaces a causal LM's loss; {built.name} is {built.kind}")
        built.run = loss_run(recipe, built.forward_context)
        built.notes.append(
            "loss: Liger's fused linear cross-entropy (logits made and turned into gradients "
            "chunk by chunk in forward; the Triton kernel's in-place writes modelled)"
            if recipe.fused_ce
            else f"loss: torchtune's chunked output head + CEWithChunkedOutputLoss over "
            f"{recipe.loss_chunks} sequence chunks (fp32 upcast per chunk)"
        )
    if recipe.packing:
        if not built.sequence:
            raise UserError(f"--packing packs token sequences; {built.name} takes none")
        built.notes.append(
            "packed sequences: every step holds batch x seq-len real tokens (no padding), as "
            "traced; attention over the packed documents (flash-attn varlen or position ids) "
            "costs what causal attention over seq-len costs"
        )
