"""Transformer memory from a config alone, in microseconds: model states, activations
(Korthikanti et al. 2022), logits, KV cache, tensor/sequence parallelism, GQA, MoE, LoRA.

Per layer and 16-bit activations, Korthikanti et al. ("Reducing Activation Recomputation
in Large Transformer Models", MLSys 2023, eq. 1) keep ``s·b·h·(34 + 5·a·s/h)`` bytes: 11sbh
+ 5as²b in attention, 19sbh in the MLP, 4sbh in the two layer norms. A memory-efficient
attention kernel (flash/SDPA) drops the ``5as²b`` term; tensor parallelism of degree t
divides all but the 10sbh of layer-norm and dropout inputs, and sequence parallelism
divides those too. For gated MLPs (Llama's SwiGLU) and grouped-query attention the same
bookkeeping is done term by term::

    >>> shape = TransformerShape(layers=32, hidden=4096, heads=32, kv_heads=8,
    ...                          intermediate=14336, vocab=128256, gated_mlp=True)
    >>> shape.parameters()
    8030261248
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vramplan.analytic.states import model_state_bytes
from vramplan.errors import UserError
from vramplan.recipe import Recipe
from vramplan.result import Component, Estimate, ModelInfo, Peak, Phase, empty_components

DECODERS = {
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gpt2",
    "gemma",
    "phi3",
    "mixtral",
    # parameter counts checked against the published ones (benchmarks/catalog_check.py)
    "gemma2",
    "gemma3_text",
    "phi",
    "opt",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v2",
    "deepseek_v3",
}


@dataclass(frozen=True)
class LatentAttention:
    """DeepSeek's multi-head latent attention: keys and values (and, with ``q_rank``,
    queries) pass through a low-rank latent, each head's query and key split into a part
    without positions (``nope_dim``) and a rotary part (``rope_dim``)::

        >>> LatentAttention(kv_rank=512, q_rank=0, nope_dim=128, rope_dim=64,
        ...                 value_dim=128).parameters(hidden=2048, heads=16)
        13763072
    """

    kv_rank: int
    q_rank: int
    nope_dim: int
    rope_dim: int
    value_dim: int

    def parameters(self, hidden: int, heads: int) -> int:
        qk = heads * (self.nope_dim + self.rope_dim)
        if self.q_rank:  # down-projection, its norm, up-projection
            query = hidden * self.q_rank + self.q_rank + self.q_rank * qk
        else:
            query = hidden * qk
        kv_up = self.kv_rank * heads * (self.nope_dim + self.value_dim)
        key_value = hidden * (self.kv_rank + self.rope_dim) + self.kv_rank + kv_up
        return query + key_value + heads * self.value_dim * hidden


@dataclass(frozen=True)
class TransformerShape:
    """The sizes the formulas need, read from a config."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    gated_mlp: bool = True
    tied_embeddings: bool = False
    positions: int = 0
    """Learned position embeddings (GPT-2, OPT); 0 for rotary models."""
    qkv_bias: bool = False
    biases: bool = False
    experts: int = 1
    experts_per_token: int = 1
    dropout: bool = False
    head_size: int = 0
    """Each head's width where the config sets it (``head_dim``); 0: hidden // heads."""
    qk_norm: bool = False
    """A norm over each head's queries and keys (Qwen3, Gemma 3)."""
    norms_per_layer: int = 2
    final_norm: bool = True
    head_bias: bool = False
    embed_width: int = 0
    """Token embeddings narrower than the layers (OPT-350m), projected in and out; 0: hidden."""
    expert_intermediate: int = 0
    """Each expert's MLP width where it differs from ``intermediate`` (the dense layers')."""
    shared_intermediate: int = 0
    """The MLP width of the experts every token goes through (DeepSeek, Qwen-MoE)."""
    shared_gate: bool = False
    dense_layers: int = 0
    """The first layers with a dense MLP instead of experts (DeepSeek)."""
    latent: LatentAttention | None = None

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    def attention_parameters(self) -> int:
        h, d = self.hidden, self.head_dim
        if self.latent is not None:
            return self.latent.parameters(h, self.heads)
        q, kv = self.heads * d, self.kv_heads * d
        attention = 2 * h * q + 2 * h * kv
        if self.qkv_bias or self.biases:
            attention += q + 2 * kv
        if self.biases:
            attention += h
        return attention + (2 * d if self.qk_norm else 0)

    def mlp_parameters(self, width: int) -> int:
        mlp = (3 if self.gated_mlp else 2) * self.hidden * width
        return mlp + (width + self.hidden if self.biases else 0)

    def layer_parameters(self, dense: bool = False) -> int:
        """One layer's parameters: with experts where the model has them, or (``dense``)
        one of the first layers DeepSeek keeps dense."""
        norms = self.norms_per_layer * self.hidden * (2 if self.biases else 1)
        if dense or self.experts == 1:
            return self.attention_parameters() + self.mlp_parameters(self.intermediate) + norms
        experts = self.experts * self.mlp_parameters(self.expert_intermediate or self.intermediate)
        shared = self.mlp_parameters(self.shared_intermediate) if self.shared_intermediate else 0
        router = self.hidden * (self.experts + self.shared_gate)
        return self.attention_parameters() + experts + shared + router + norms

    def parameters(self) -> int:
        width = self.embed_width or self.hidden
        embeddings = self.vocab * width + self.positions * self.hidden
        projections = 2 * width * self.hidden if width != self.hidden else 0
        head = 0 if self.tied_embeddings else self.vocab * width + self.head_bias * self.vocab
        final_norm = self.final_norm * (2 if self.biases else 1) * self.hidden
        layers = self.dense_layers * self.layer_parameters(dense=True)
        layers += (self.layers - self.dense_layers) * self.layer_parameters()
        return embeddings + projections + layers + final_norm + head


def shape_from_config(config: dict) -> TransformerShape:
    """A TransformerShape from a Hugging Face config dict (decoder-only models); a
    UserError naming the first field the formulas need and the config lacks."""
    try:
        return _shape_from_config(config)
    except KeyError as exc:
        raise UserError(
            f"config {config.get('model_type', '')!r} lacks {exc.args[0]}, which the "
            "transformer formulas need"
        ) from None


def _shape_from_config(config: dict) -> TransformerShape:
    kind = config.get("model_type", "")
    if kind not in DECODERS:
        raise UserError(
            f"transformer formulas cover decoder-only models "
            f"({', '.join(sorted(DECODERS))}); got model_type {kind!r}: "
            "trace it with `vramplan estimate` instead"
        )
    if kind == "gpt2":
        hidden = config["n_embd"]
        return TransformerShape(
            layers=config["n_layer"],
            hidden=hidden,
            heads=config["n_head"],
            kv_heads=config["n_head"],
            intermediate=config.get("n_inner") or 4 * hidden,
            vocab=config["vocab_size"],
            gated_mlp=False,
            tied_embeddings=config.get("tie_word_embeddings", True),
            positions=config["n_positions"],
            biases=True,
            dropout=True,
        )
    if kind == "opt":
        return _opt_shape(config)
    heads = config["num_attention_heads"]
    shape = TransformerShape(
        layers=config["num_hidden_layers"],
        hidden=config["hidden_size"],
        heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads,
        intermediate=config["intermediate_size"],
        vocab=config["vocab_size"],
        tied_embeddings=config.get("tie_word_embeddings", kind.startswith("gemma")),
        qkv_bias=kind.startswith("qwen2") or config.get("attention_bias", False),
        experts=config.get("num_local_experts") or config.get("num_experts") or 1,
        experts_per_token=config.get("num_experts_per_tok") or 1,
        head_size=config.get("head_dim") or 0,
        qk_norm=kind in ("qwen3", "qwen3_moe", "gemma3_text"),
        norms_per_layer=4 if kind in ("gemma2", "gemma3_text") else 2,
        expert_intermediate=config.get("moe_intermediate_size") or 0,
        shared_intermediate=config.get("shared_expert_intermediate_size") or 0,
        shared_gate=kind == "qwen2_moe",
    )
    if kind == "phi":  # biases everywhere, one norm before attention and MLP side by side
        return replace(
            shape,
            gated_mlp=False,
            biases=True,
            norms_per_layer=1,
            head_bias=True,
            dropout=bool(config.get("resid_pdrop")),
        )
    if kind.startswith("deepseek"):
        return replace(
            shape,
            experts=config["n_routed_experts"],
            shared_intermediate=config["moe_intermediate_size"] * config["n_shared_experts"],
            dense_layers=config.get("first_k_dense_replace") or 0,
            latent=LatentAttention(
                kv_rank=config["kv_lora_rank"],
                q_rank=config.get("q_lora_rank") or 0,
                nope_dim=config["qk_nope_head_dim"],
                rope_dim=config["qk_rope_head_dim"],
                value_dim=config["v_head_dim"],
            ),
        )
    return shape


def _opt_shape(config: dict) -> TransformerShape:
    """OPT: learned positions (two more than the longest sequence), biases, and in
    OPT-350m embeddings narrower than the layers and no final norm."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    return TransformerShape(
        layers=config["num_hidden_layers"],
        hidden=hidden,
        heads=heads,
        kv_heads=heads,
        intermediate=config["ffn_dim"],
        vocab=config["vocab_size"],
        gated_mlp=False,
        tied_embeddings=config.get("tie_word_embeddings", True),
        positions=config["max_position_embeddings"] + 2,
        biases=config.get("enable_bias", True),
        dropout=bool(config.get("dropout")),
        embed_width=config.get("word_embed_proj_dim") or hidden,
        final_norm=config.get("do_layer_norm_before", True),
    )


@dataclass(frozen=True)
class Parallelism:
    """Megatron-style tensor (and sequence) parallel degree."""

    tensor: int = 1
    sequence: bool = False


def layer_activation_bytes(
    shape: TransformerShape,
    seq: int,
    batch: int,
    flash: bool,
    parallel: Parallelism = Parallelism(),
    act: int = 2,
) -> int:
    """Bytes one layer keeps for backward, 16-bit activations by default.

    For GPT-2 style layers this is Korthikanti's ``sbh(34 + 5as/h)`` (with ``act=2``)."""
    s, b, h, a = seq, batch, shape.hidden, shape.heads
    t = parallel.tensor
    kv = shape.kv_heads / shape.heads
    unit = s * b * h * act / 2  # "sbh": a 16-bit tensor of s·b·h values is 2 units
    mask = unit if shape.dropout else 0  # 1-byte dropout masks
    inputs = 2 * unit + 2 * unit  # inputs of the QKV projection and of the MLP
    # attention: Q (2), K and V (2 each, scaled for grouped-query heads), output-projection
    # input (2), output dropout mask -> 11 sbh with the QKV input, for multi-head attention
    attention = (2 + 4 * kv + 2) * unit + mask
    scores = 4 * a * s * b if flash else (2 + (3 if shape.dropout else 0)) * a * s * s * b * act / 2
    routed = (shape.expert_intermediate or shape.intermediate) * shape.experts_per_token
    inter = (routed if shape.experts > 1 else shape.intermediate) / h
    inter += shape.shared_intermediate / h
    # gated (SwiGLU): gate and up outputs and the activation's output; else the GELU input
    # and output: 8 + 8 sbh for a 4h MLP, plus its dropout mask
    mlp = (6 if shape.gated_mlp else 4) * inter * unit + mask
    norms = 4 * unit
    replicated = norms + inputs + 2 * mask
    sharded = attention + mlp - 2 * mask
    if t == 1:
        return int(replicated + sharded + scores)
    if parallel.sequence:
        return int((replicated + sharded + scores) / t)
    return int(replicated + (sharded + scores) / t)


def kv_cache_bytes(shape: TransformerShape, seq: int, batch: int, act: int = 2) -> int:
    """``2 · layers · kv_heads · head_dim · seq · batch · bytes``.

    >>> kv_cache_bytes(TransformerShape(32, 4096, 32, 8, 14336, 128256), 8192, 1)
    1073741824
    """
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * seq * batch * act


@dataclass(frozen=True)
class LoRA:
    """Low-rank adapters on every attention and MLP matrix; ``bits=4`` for QLoRA."""

    rank: int
    bits: int = 16

    def adapter_parameters(self, shape: TransformerShape) -> int:
        h, kv = shape.hidden, shape.kv_heads * shape.head_dim
        pairs = [(h, h), (h, kv), (h, kv), (h, h)]
        mlp = [(h, shape.intermediate)] * (3 if shape.gated_mlp else 2)
        return shape.layers * sum(self.rank * (i + o) for i, o in pairs + mlp)

    def base_bytes_per_param(self) -> float:
        # NF4 with double quantisation: 4 bits plus ~0.127 bits of constants (QLoRA paper)
        return 0.5 + 0.127 / 8 if self.bits == 4 else 2.0


def transformer_estimate(
    config: dict,
    recipe: Recipe,
    name: str,
    flash: bool = True,
    parallel: Parallelism = Parallelism(),
    recompute: str = "none",
    lora: LoRA | None = None,
) -> Estimate:
    """Estimate a decoder-only transformer from its config by formulas."""
    shape = shape_from_config(config)
    if (
        parallel.tensor < 1
        or shape.heads % parallel.tensor
        or shape.kv_heads % parallel.tensor
        and shape.kv_heads >= parallel.tensor
    ):
        raise UserError(
            f"tensor parallel degree {parallel.tensor} must divide the "
            f"{shape.heads} attention heads"
        )
    seq = recipe.seq_len or 512
    batch = recipe.batch_size
    act = 4 if recipe.precision == "fp32" else 2
    params = shape.parameters()
    components = empty_components()
    t = parallel.tensor
    if lora is not None:
        trainable = lora.adapter_parameters(shape)
        components[Component.PARAMETERS] = int(params * lora.base_bytes_per_param()) + trainable * 4
        states = model_state_bytes(trainable, "fp32", recipe.optimizer, training=recipe.is_training)
        components[Component.GRADIENTS], components[Component.OPTIMIZER_STATE] = (
            states[Component.GRADIENTS],
            states[Component.OPTIMIZER_STATE],
        )
    else:
        trainable = params
        states = model_state_bytes(
            params, recipe.precision, recipe.optimizer, training=recipe.is_training
        )
        components.update({k: v // t for k, v in states.items()})
    terms = {}
    if recipe.is_training:
        per_layer = layer_activation_bytes(replace(shape), seq, batch, flash, parallel, act)
        if recompute == "full":
            per_layer = seq * batch * shape.hidden * act  # only each layer's input is kept
        elif recompute == "selective":
            per_layer = layer_activation_bytes(shape, seq, batch, True, parallel, act)
        terms["layers"] = shape.layers * per_layer
        # logits in the compute dtype, then fp32 for the loss (the largest single tensors)
        terms["logits"] = seq * batch * shape.vocab * (act + 4 + 4) // t
        terms["embeddings"] = seq * batch * shape.hidden * act
        components[Component.ACTIVATIONS] = sum(terms.values())
    else:
        terms["kv_cache"] = kv_cache_bytes(shape, seq, batch, act) // t
        terms["logits"] = seq * batch * shape.vocab * act // t
        components[Component.ACTIVATIONS] = terms["kv_cache"] + terms["logits"]
    components[Component.INPUTS] = seq * batch * 8 * (2 if recipe.is_training else 1)
    info = ModelInfo(
        name=name,
        parameters=params,
        trainable_parameters=trainable,
        parameter_bytes=components[Component.PARAMETERS],
        kind="causal-lm",
        architecture=config.get("model_type", ""),
    )
    notes = [
        "transformer formulas (Korthikanti et al. 2022, term by term): they leave out the "
        "allocator, the runtime, optimizer-step temporaries and backward's transient "
        "gradients; trace with `vramplan estimate` for those"
    ]
    return Estimate(
        model=info,
        recipe=recipe,
        peak=Peak(
            allocated_bytes=sum(components.values()),
            phase=Phase.BACKWARD if recipe.is_training else Phase.FORWARD,
        ),
        components=components,
        method="analytic",
        notes=tuple(notes),
        details={
            "formula_terms": terms,
            "flash_attention": flash,
            "tensor_parallel": t,
            "sequence_parallel": parallel.sequence,
            "recompute": recompute,
            "lora_rank": lora.rank if lora else 0,
            "kv_cache_bytes": kv_cache_bytes(shape, seq, batch, act) // t,
        },
    )
