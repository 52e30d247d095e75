"""The loss of a causal language model computed as recipe libraries compute it, so that the
``[batch, seq, vocab]`` logits are never whole.

- ``--loss-chunks N``: torchtune's ``CEWithChunkedOutputLoss`` (``torchtune/modules/loss``)
  with its chunked output head (``TransformerDecoder(num_output_chunks=N)``): the final
  hidden states split into N chunks along the sequence, the head applied to each chunk,
  each chunk's logits upcast to fp32 and reduced with ``cross_entropy(reduction="sum")``,
  the sum divided by the token count. What autograd keeps is what it really keeps for
  those ops.
- ``--fused-ce``: Liger-Kernel's ``LigerFusedLinearCrossEntropyFunction``
  (``liger_kernel/ops/fused_linear_cross_entropy.py``): rows of the flattened hidden states
  in chunks of ``next_power_of_2(ceil(BT / ceil(V / H)))``; each chunk's logits
  ``[chunk, V]`` in the input's dtype are overwritten in place by their gradient (the
  Triton cross-entropy kernel), which is multiplied into ``grad_input`` (``[BT, H]``,
  kept for backward) and added into ``grad_weight`` (``[V, H]``, only if the head trains).
  Backward only scales ``grad_input`` in place. The Triton kernel itself does not run on
  the CPU: its in-place writes are modelled, its register work allocates nothing.

- ``--loss-shift-copy``: transformers' own ``ForCausalLMLoss`` as it was before 4.49
  (``loss/loss_utils.py``; huggingface/transformers PR #35646, January 2025, removed the
  copy): the logits upcast to fp32, then ``logits[..., :-1, :].contiguous()``, a second
  fp32 copy of them, alive with the first while ``cross_entropy`` runs. Later versions
  pad the labels instead and keep no copy.

All three replace the model's own loss (the head and loss of ``XForCausalLM.forward``); labels
are shifted by one as transformers' ``ForCausalLMLoss`` shifts them. The backbone and head
run inside the model's own call (``in_root_forward``), as both libraries run them:
torchtune's chunked head is applied in ``TransformerDecoder.forward`` (``num_output_chunks``)
and its recipe computes the loss on the returned chunks; Liger's ``lce_forward``, patched over
``XForCausalLM.forward``, computes the fused loss inside it. Under FSDP2 that call is the
root's, whose forward pre-hook gathers the embeddings, final norm and head::

    run = loss_run(Recipe(loss_chunks=8))
    loss = run(model, {"input_ids": ids, "labels": ids}, True)
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from vramplan.recipe import Recipe
from vramplan.trace.compiled import CompiledRegion

IGNORE_INDEX = -100


def _parts(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The decoder body and the output head of a causal LM (through a peft wrapper)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), base.get_output_embeddings()


def _targets(batch: dict) -> torch.Tensor:
    """The labels shifted by one, padded with ``IGNORE_INDEX`` (no copy of the logits)."""
    return F.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[:, 1:]


def _hidden(model: nn.Module, batch: dict) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return _parts(model)[0](**inputs).last_hidden_state


def chunked_logits(model: nn.Module, batch: dict, chunks: int) -> list[torch.Tensor]:
    """``TransformerDecoder.forward`` with ``num_output_chunks``: the head applied to each
    sequence chunk of the final hidden states (``chunked_output``), the list returned."""
    head = _parts(model)[1]
    return [head(chunk) for chunk in _hidden(model, batch).chunk(chunks, dim=1)]


def chunked_loss(
    model: nn.Module, batch: dict, chunks: int, compiled: bool = False
) -> torch.Tensor:
    """torchtune's chunked output head, inside the model's own call as in its recipes
    (``logits = self._model(**batch)``), then ``CEWithChunkedOutputLoss`` outside it (with
    ``compiled``, its ``compute_cross_entropy`` compiled as ``compile_loss`` does)."""
    logits = in_root_forward(model, lambda m, inputs: chunked_logits(m, inputs, chunks), batch)
    targets = _targets(batch)
    labels = [t.reshape(-1) for t in targets.chunk(chunks, dim=1)]
    cross_entropy = COMPILED_CROSS_ENTROPY if compiled else compute_cross_entropy
    total = 0.0
    for logit, label in zip(logits, labels, strict=True):
        total = total + cross_entropy(logit.reshape(-1, logit.size(-1)), label)
    return total / targets.numel()


def compute_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``CEWithChunkedOutputLoss.compute_cross_entropy``: one chunk's upcast and sum."""
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


COMPILED_CROSS_ENTROPY = CompiledRegion(compute_cross_entropy)
"""torchtune's ``compile_loss`` compiles only ``compute_cross_entropy`` of the chunked loss."""


def liger_chunk_size(rows: int, vocab: int, hidden: int) -> int:
    """Liger's chunk: ``next_power_of_2(ceil(BT / ceil(V / H)))`` rows.

    >>> liger_chunk_size(8192, 128256, 4096)
    256
    """
    factor = -(-vocab // hidden)
    return 1 << max(0, (-(-rows // factor)) - 1).bit_length()


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Liger's fused linear cross-entropy: loss and gradients made chunk by chunk in
    forward, only ``grad_input`` (and ``grad_weight``) kept for backward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets):
        rows, width = hidden.shape
        size = liger_chunk_size(rows, weight.shape[0], width)
        grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
        grad_input = torch.zeros_like(hidden)
        losses = torch.zeros(rows, dtype=torch.float32, device=hidden.device)
        for start in range(0, rows, size):
            piece = hidden[start : start + size]
            logits = piece @ weight.t()  # overwritten in place by its gradient (Triton)
            grad_input[start : start + size] = logits @ weight
            if grad_weight is not None:
                torch.addmm(grad_weight, logits.t().to(piece.dtype), piece, out=grad_weight)
            del logits
        loss = losses.sum() / rows
        ctx.save_for_backward(grad_input, grad_weight)
        del targets
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_weight = ctx.saved_tensors
        grad_input.mul_(grad_output)  # Liger's element_mul_kernel, in place
        if grad_weight is not None:
            grad_weight.mul_(grad_output)
        return grad_input, grad_weight, None


def fused_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Liger's fused linear cross-entropy over the decoder's last hidden states, inside the
    model's own call as Liger's ``lce_forward`` (patched over ``XForCausalLM.forward``)
    computes it."""

    def forward(model: nn.Module, inputs: dict) -> torch.Tensor:
        hidden = _hidden(model, inputs)
        flat = hidden.reshape(-1, hidden.shape[-1])
        head = _parts(model)[1]
        return _FusedLinearCrossEntropy.apply(flat, head.weight, _targets(inputs).reshape(-1))

    return in_root_forward(model, forward, batch)


def shift_copy_loss(model: nn.Module, batch: dict, upcast: bool = True) -> torch.Tensor:
    """transformers < 4.49's ``ForCausalLMLoss``: fp32 logits, shifted with a copy. With
    ``upcast=False`` the loss the models that kept their own computed through 4.48
    (``GPTBigCodeForCausalLM.forward``, GPT-2's): ``CrossEntropyLoss`` over a contiguous
    copy of the shifted logits in their own dtype. The model's own forward makes the
    logits (so a sharded root's hooks gather its embeddings and head)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits
    # ForCausalLMLoss's upcast is a local: alive until it returns
    source = logits.float() if upcast else logits
    shifted = source[..., :-1, :].contiguous()
    labels = batch["labels"][..., 1:].contiguous()
    return F.cross_entropy(
        shifted.view(-1, shifted.size(-1)), labels.view(-1), ignore_index=IGNORE_INDEX
    )


def in_root_forward(model: nn.Module, loss: Callable[..., Any], batch: dict) -> Any:
    """``loss(model, batch)`` run as ``model``'s own forward, so that ``model``'s hooks wrap it
    as they wrap the recipes' forward. Under FSDP2 the root's pre-forward gathers its
    parameters and its post-forward reshards them as its ``reshard_after_forward`` says: a
    root given ``True`` explicitly (as ``Fsdp2`` and torchtune's ``shard_model`` give it)
    reshards; only an unset (``None``) one stays gathered, ``FSDPState._lazy_init`` clearing
    its ``post_forward_mesh_info`` (``torch/distributed/fsdp/_fully_shard/_fsdp_state.py``)::

        loss = in_root_forward(model, fused_loss, {"input_ids": ids, "labels": ids})
    """
    model.forward = lambda **inputs: loss(model, inputs)
    try:
        return model(**batch)
    finally:
        del model.forward


def loss_run(
    recipe: Recipe, forward_context: Callable[[], AbstractContextManager] = nullcontext
) -> Callable[[nn.Module, dict, bool], Any]:
    """A ``BuiltModel.run`` for a causal LM computing its loss as the recipe says, the model
    called under ``forward_context`` (``BuiltModel.forward_context``: as its own run calls it;
    without it, transformers 5 keeps a packed-sequence mask under fake tensors)."""

    def run(module: nn.Module, batch: dict, training: bool):
        with forward_context():
            if not training:
                return module(**{k: v for k, v in batch.items() if k != "labels"})
            if recipe.fused_ce:
                return fused_loss(module, batch)
            if recipe.loss_shift_copy:
                return shift_copy_loss(module, batch, upcast=not recipe.loss_no_upcast)
            return chunked_loss(module, batch, recipe.loss_chunks, recipe.compile)

    return run
