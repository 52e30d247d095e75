"""transformers 4.x's Mixtral experts (``--experts linear``): every expert three
``nn.Linear`` and the router an ``nn.Linear``, run by 4.x's per-expert loop.

transformers 5 holds a layer's experts as two 3-D parameters (``MixtralExperts.gate_up_proj``
``[experts, 2 x ffn, hidden]``, ``down_proj``) and the router as ``MixtralTopKRouter``.
transformers 4.48 (``models/mixtral/modeling_mixtral.py``) built ``MixtralSparseMoeBlock``
from ``gate = nn.Linear(hidden, experts)`` and one ``MixtralBlockSparseTop2MLP`` per expert
(``w1``, ``w3``: hidden → ffn; ``w2``: ffn → hidden), so bitsandbytes' ``load_in_4bit``
quantized every one of them (``get_keys_to_not_convert`` keeps only the output head), and
each expert's ``Linear4bit`` dequantizes its own weights inside the loop. Rebuilding that
layout lets ``--quantize`` reach the experts; the parameter count is the same::

    >>> from transformers import MixtralConfig
    >>> config = MixtralConfig(hidden_size=8, intermediate_size=12, num_local_experts=4)
    >>> block = LinearExpertsBlock(config, "balanced", device="meta")
    >>> sum(p.numel() for p in block.parameters())  # 4 x 3 x 8 x 12 + 4 x 8
    1184

The loop's per-expert token counts are data (``torch.where`` over the expert mask); they are
sized by ``--moe-routing`` (``hf_moe.expert_loads``), as ``--experts eager`` does. The block
keeps transformers 5's attribute name, ``mlp`` (4.x called it ``block_sparse_moe``), because
5's decoder layer calls ``self.mlp``; it returns the hidden states only (4.x also returned
the router logits, which the decoder layer drops unless ``output_router_logits``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vramplan.errors import UserError
from vramplan.sources.hf_moe import expert_loads


class ExpertMLP(nn.Module):
    """4.48's ``MixtralBlockSparseTop2MLP``: ``w2(act(w1(x)) * w3(x))``."""

    def __init__(self, config, device) -> None:
        from transformers.activations import ACT2FN  # transformers is an optional extra

        super().__init__()
        hidden, ffn = config.hidden_size, config.intermediate_size
        self.w1 = nn.Linear(hidden, ffn, bias=False, device=device)
        self.w2 = nn.Linear(ffn, hidden, bias=False, device=device)
        self.w3 = nn.Linear(hidden, ffn, bias=False, device=device)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states))


class LinearExpertsBlock(nn.Module):
    """4.48's ``MixtralSparseMoeBlock.forward`` with the tokens per expert set by ``routing``
    (``balanced`` or ``worst``) instead of read from the router's choice."""

    def __init__(self, config, routing: str, device) -> None:
        super().__init__()
        self.hidden_dim = config.hidden_size
        self.num_experts = config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.routing = routing
        self.gate = nn.Linear(self.hidden_dim, self.num_experts, bias=False, device=device)
        self.experts = nn.ModuleList(ExpertMLP(config, device) for _ in range(self.num_experts))
        self.jitter_noise = config.router_jitter_noise

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, sequence, hidden = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            noise = torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise, 1.0 + self.jitter_noise
            )
            hidden_states *= noise
        hidden_states = hidden_states.view(-1, hidden)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final = torch.zeros(
            (batch * sequence, hidden), dtype=hidden_states.dtype, device=hidden_states.device
        )
        # 4.x's expert mask, alive through the loop (its torch.where reads it per expert)
        expert_mask = F.one_hot(selected, num_classes=self.num_experts).permute(2, 1, 0)
        loads = expert_loads(batch * sequence, self.top_k, self.num_experts, self.routing)
        for expert, count in zip(self.experts, loads, strict=True):
            if not count:  # an expert without tokens allocates nothing
                continue
            # torch.where(expert_mask[expert_idx]): the top-k slots and tokens routed here
            idx = torch.zeros(count, dtype=torch.long, device=final.device)
            top_x = torch.zeros(count, dtype=torch.long, device=final.device)
            state = hidden_states[None, top_x].reshape(-1, hidden)
            state = expert(state) * routing_weights[top_x, idx, None]
            final.index_add_(0, top_x, state.to(hidden_states.dtype))
        del expert_mask
        return final.reshape(batch, sequence, hidden)


def use_linear_experts(model: nn.Module, routing: str) -> None:
    """Replace every Mixtral ``MixtralSparseMoeBlock`` of ``model`` with 4.48's layout (a
    UserError when it has none)."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ != "MixtralSparseMoeBlock":
                continue
            device = child.experts.gate_up_proj.device
            setattr(parent, name, LinearExpertsBlock(model.config, routing, device))
            replaced += 1
    if not replaced:
        raise UserError(
            f"--experts linear: {type(model).__name__} has no Mixtral experts block "
            "(only Mixtral's transformers 4.x layout is rebuilt)"
        )
