"""``--attention``: which attention implementation transformers builds the model with.

``eager`` and ``sdpa`` are transformers' own (``sdpa`` on a CUDA target then runs the
kernel the card picks, ``trace/cuda_sdpa.py``). ``flash_attention_2`` needs the
``flash_attn`` package and a GPU, and compiled ``flex_attention`` needs Triton, so both are
registered in transformers' ``AttentionInterface`` under names of their own, backed by
the custom ops of ``ops/fused_attention.py`` that keep what those kernels keep (output and
log-sum-exp); the model code is unchanged::

    >>> attention_name("flash_attention_2")
    'vramplan_fa2'
    >>> check_attention_target("flash_attention_2", "cuda", "sm75")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    vramplan.errors.UserError: --attention flash_attention_2: the flash_attn kernels run on ...
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
from torch import nn

from vramplan.errors import UserError
from vramplan.ops.fused_attention import fused_attention
from vramplan.recipe import Recipe
from vramplan.trace.patching import patched

# Our registry names: without "flash" in them, so transformers does not look for the
# flash_attn package or a hub kernel when it meets them.
REGISTERED = {"flash_attention_2": "vramplan_fa2", "flex_attention": "vramplan_flex"}
_KERNEL = {"vramplan_fa2": "flash2", "vramplan_flex": "flex"}
_SUPPORT_FLAG = {
    "sdpa": "_supports_sdpa",
    "flash_attention_2": "_supports_flash_attn",
    "flex_attention": "_supports_flex_attn",
}
_FLASH_ARCHS = ("sm80", "sm86", "sm87", "sm89", "sm90", "gfx90a", "gfx942")
NOTES = {
    "eager": "attention eager: transformers' eager attention keeps the (batch, heads, "
    "query, key) softmax probabilities for backward",
    "sdpa": "attention sdpa: F.scaled_dot_product_attention",
    "flash_attention_2": "attention flash_attention_2: traced as the flash_attn package's "
    "kernels keep it (output plus an fp32 log-sum-exp per query row; backward allocates "
    "dq/dk/dv, softmax_d and an fp32 dq accumulator)",
    "flex_attention": "attention flex_attention: traced as compiled FlexAttention keeps it "
    "(output plus an fp32 log-sum-exp per query row; backward allocates dq/dk/dv and delta); "
    "its block mask (a few int32 per 128x128 tile) is not counted",
}


def attention_name(choice: str) -> str:
    """The ``attn_implementation`` transformers is given for a ``--attention`` choice."""
    return REGISTERED.get(choice, choice)


def _attention_function(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    sliding_window=None,
    softcap=None,
    is_causal=None,
    **kwargs,
):
    """transformers' attention-function signature over the fused-attention custom ops;
    (batch, heads, sequence, head_dim) in, (batch, sequence, heads, head_dim) out."""
    kernel = _KERNEL[module.config._attn_implementation]
    if attention_mask is not None:
        raise UserError(
            f"{kernel} attention: a padded batch (an attention mask) is not traced; "
            "the example batches have none"
        )
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if kernel == "flash2" and q.dtype == torch.float32:  # transformers casts to half
        if not torch.is_autocast_enabled(q.device.type):
            raise UserError(
                "--attention flash_attention_2 runs in fp16/bf16 only (FlashAttention only "
                "supports fp16 and bf16): use --precision bf16, fp16, amp-bf16 or amp-fp16"
            )
        half = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(half), k.to(half), v.to(half)
    width, v_width = q.size(-1), v.size(-1)
    if kernel == "flash2" and v_width != width:  # MLA: value padded to the query's width
        v = torch.nn.functional.pad(v, (0, width - v_width))
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
    window = sliding_window - 1 if sliding_window else -1
    out = fused_attention(kernel, q, k, v, dropout, scaling, bool(causal), window)
    if kernel == "flex":  # (B, H, S, D) as the kernel writes it; transformers copies it
        return out.transpose(1, 2).contiguous(), None
    return (out[..., :v_width] if v_width != width else out), None


def register(transformers) -> None:
    """Register the fused kernels with transformers (idempotent)."""
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    for name in REGISTERED.values():
        transformers.AttentionInterface.register(name, _attention_function)
        AttentionMaskInterface.register(name, flash_attention_mask)


def check_attention(choice: str, model_class, recipe: Recipe, label: str) -> None:
    """Refuse an attention implementation the model or the precision cannot run, where
    transformers (or the kernel) would."""
    flag = _SUPPORT_FLAG.get(choice)
    if flag and not getattr(model_class, flag, False):
        raise UserError(
            f"{label}: {model_class.__name__} does not support --attention {choice} in "
            "transformers (use eager" + (" or sdpa)" if choice != "sdpa" else ")")
        )
    if choice == "flash_attention_2" and recipe.precision == "fp32":
        raise UserError(
            "--attention flash_attention_2 runs in fp16/bf16 only (FlashAttention only "
            "supports fp16 and bf16): use --precision bf16, fp16, amp-bf16 or amp-fp16"
        )


def check_attention_target(choice: str | None, target: str, arch: str) -> None:
    """Refuse FlashAttention-2 where its kernels do not run: the CPU, GPUs before Ampere
    and the sm100/sm120 parts ``mha_fwd``/``mha_bwd`` reject."""
    if choice != "flash_attention_2":
        return
    if target == "cpu":
        raise UserError(
            "--attention flash_attention_2: the flash_attn package has no CPU kernels "
            "(use --target cuda)"
        )
    if arch not in _FLASH_ARCHS:
        raise UserError(
            "--attention flash_attention_2: the flash_attn kernels run on Ampere (sm80-sm89) "
            f"and Hopper (sm90) GPUs and AMD MI200/MI300; the card is {arch} "
            "(use --attention sdpa)"
        )


@contextlib.contextmanager
def repeated_kv() -> Iterator[None]:
    """``--repeat-kv``: transformers' SDPA attention repeats K and V to every query head
    (``repeat_kv``) instead of passing ``enable_gqa``, as transformers before 4.54 always
    did (4.48.1 and 4.52.1 read: ``sdpa_attention_forward`` calls ``repeat_kv``
    unconditionally) and as torchtune's ``MultiHeadAttention`` does (0.6.1 read:
    ``k.unsqueeze(2).expand(...).flatten(1, 2)`` before SDPA). The repeated copies are what
    SDPA saves for backward."""
    module = sys.modules.get("transformers.integrations.sdpa_attention")
    if not hasattr(module, "use_gqa_in_sdpa"):  # a transformers that always repeats
        yield
        return
    with patched([(module, "use_gqa_in_sdpa", lambda *_args, **_kwargs: False)]):
        yield


def repeat_kv_note(model: nn.Module, recipe: Recipe) -> str | None:
    """What ``--repeat-kv`` does to ``model``: None where it repeats K and V (grouped-query
    attention through transformers' SDPA), else the note that says why nothing changes (a
    torchtune recipe turns it on for its builders whatever model the command names)."""
    if not recipe.repeat_kv:
        return None
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    if heads is None or kv_heads is None or kv_heads >= heads:
        return "--repeat-kv changes nothing: the model has no grouped-query attention"
    implementation = getattr(config, "_attn_implementation", None)
    if implementation != "sdpa":
        return (
            f"--repeat-kv changes nothing: {implementation} attention takes K and V as "
            "transformers' own code gives them"
        )
    return None
