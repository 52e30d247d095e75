"""Mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3) traced with a
stated routing policy.

transformers runs the experts through its ``ExpertsInterface``. Its default on GPUs,
``grouped_mm``, computes every (token, chosen expert) row in one grouped matmul, so its
activations (tokens x top_k rows) are the same whichever experts the router picks.
``--experts eager`` is transformers' per-expert loop (the only path of transformers 4.x;
``--experts linear`` also rebuilds 4.x's per-expert ``nn.Linear`` layers, ``hf_moe_linear``):
each expert gathers the tokens routed to it, and those counts are data (``nonzero``,
``where``) that fake tensors do not have. The loop is re-run with the counts of a policy::

    >>> expert_loads(tokens=10, top_k=2, experts=8, routing="balanced")
    [3, 3, 3, 3, 2, 2, 2, 2]
    >>> expert_loads(tokens=10, top_k=2, experts=8, routing="worst")
    [10, 10, 0, 0, 0, 0, 0, 0]

``balanced`` spreads the tokens x top_k assignments evenly over the experts. ``worst``
sends every token to the same top_k experts: the total rows are fixed at tokens x top_k
by the router, and a token picks an expert at most once, so no routing gives one expert
more than every token — the largest per-expert working set the loop can allocate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vramplan.errors import UserError
from vramplan.recipe import Recipe


def expert_loads(tokens: int, top_k: int, experts: int, routing: str) -> list[int]:
    """Tokens each expert receives under ``routing`` (``balanced`` or ``worst``)."""
    if routing == "worst":
        return [tokens] * top_k + [0] * (experts - top_k)
    base, extra = divmod(tokens * top_k, experts)
    return [base + 1] * extra + [base] * (experts - extra)


def _eager_experts(routing: str):
    """transformers' per-expert loop (``MixtralExperts.forward`` before the interface),
    with the data-dependent index tensors sized by ``routing``."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if getattr(self, "has_bias", False) or getattr(self, "is_transposed", False):
            raise UserError(
                f"--experts eager: {type(self).__name__} has biased or transposed experts; "
                "only gated experts without bias are emulated (use --experts grouped_mm)"
            )
        tokens, top_k = top_k_index.shape
        final = torch.zeros_like(hidden_states)
        loads = expert_loads(tokens, top_k, self.num_experts, routing)
        with torch.no_grad():  # one_hot, permute, sum, greater, nonzero, as transformers does
            mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            torch.greater(mask.sum(dim=(-1, -2)), 0)
            torch.zeros((sum(1 for n in loads if n), 1), dtype=torch.long)  # nonzero's
        for expert, count in enumerate(loads):
            if not count:
                continue
            # torch.where(mask[expert]): two index tensors of the expert's token count
            top_k_pos = torch.zeros(count, dtype=torch.long)
            token_idx = torch.zeros(count, dtype=torch.long)
            state = hidden_states[token_idx]
            gate_up = F.linear(state, self.gate_up_proj[expert])
            state = self._apply_gate(gate_up)
            state = F.linear(state, self.down_proj[expert])
            state = state * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, state.to(final.dtype))
        return final

    return forward


def experts_name(recipe: Recipe) -> str | None:
    """The ``experts_implementation`` transformers is given (None: its default, also for
    ``linear``, whose blocks replace transformers' experts after the model is built)."""
    if recipe.experts == "linear":
        return None
    if recipe.experts == "eager":
        return f"vramplan_eager_{recipe.moe_routing}"
    return recipe.experts


def register(transformers) -> None:
    """Register the policy-routed per-expert loops with transformers (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    for routing in ("balanced", "worst"):
        ExpertsInterface.register(f"vramplan_eager_{routing}", _eager_experts(routing))


def moe_note(config, recipe: Recipe, tokens: int) -> str:
    """What the trace assumed about routing, for the Estimate's notes."""
    experts = _experts(config)
    top_k = config.num_experts_per_tok
    if recipe.experts not in ("eager", "linear"):
        return (
            f"mixture of experts ({experts} experts, top {top_k}): traced as transformers' "
            "grouped_mm, whose activations (tokens x top_k rows) do not depend on which "
            "experts the router picks; --experts eager traces the per-expert loop with "
            "--moe-routing"
        )
    loads = expert_loads(tokens, top_k, experts, recipe.moe_routing)
    spread = (
        f"every expert gets about {tokens} x {top_k} / {experts} tokens"
        if recipe.moe_routing == "balanced"
        else f"all {tokens} tokens go to the same {top_k} experts"
    )
    layout = (
        "transformers 4.x's per-expert nn.Linear layers and router, its per-expert loop"
        if recipe.experts == "linear"
        else "transformers' per-expert loop"
    )
    return (
        f"mixture of experts ({experts} experts, top {top_k}): {layout}, "
        f"{recipe.moe_routing} routing ({spread}; largest expert load {max(loads)} "
        "tokens per layer); which experts real data picks is not known in advance"
    )


def _experts(config) -> int:
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    raise UserError(f"{config.model_type}: cannot find the number of experts in the config")


def is_moe(config) -> bool:
    """Whether the config describes a routed mixture-of-experts model."""
    return isinstance(getattr(config, "num_experts_per_tok", None), int)
