"""What the fine-tuning sweep (benchmarks/results/2026-11-27-finetune-sweep.md) found.
Which linears ``--quantize`` replaces: the ones transformers' bitsandbytes quantizer
replaces (ground truth: transformers' own ``replace_with_bnb_linear`` with the quantizer's
``modules_to_not_convert``, run on the meta device); what peft says when its default
targets find nothing."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")
quantizers = pytest.importorskip("transformers.quantizers.base")

from transformers.integrations.bitsandbytes import replace_with_bnb_linear  # noqa: E402

from vramplan import Recipe  # noqa: E402
from vramplan.pipeline import trace_and_estimate  # noqa: E402
from vramplan.sources import resolve  # noqa: E402
from vramplan.sources.quantized import QuantizedLinear  # noqa: E402

TINY_T5 = {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"],
           "d_model": 32, "d_ff": 64, "d_kv": 16, "num_heads": 2, "num_layers": 2,
           "vocab_size": 128, "feed_forward_proj": "gated-gelu", "decoder_start_token_id": 0,
           "pad_token_id": 0}  # fmt: skip
TINY_VIT = {"model_type": "vit", "architectures": ["ViTForImageClassification"],
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "image_size": 32, "patch_size": 16,
            "num_labels": 5}  # fmt: skip


def transformers_quantized(config: dict) -> set[str]:
    """Names of the linears transformers' 4-bit quantizer turns into ``Linear4bit``."""
    cfg = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = getattr(transformers, config["architectures"][0])(cfg)
    skip = quantizers.HfQuantizer.get_modules_to_not_convert(
        model, None, model._keep_in_fp32_modules
    )
    bnb_config = transformers.BitsAndBytesConfig(load_in_4bit=True)
    model = replace_with_bnb_linear(
        model, modules_to_not_convert=skip, quantization_config=bnb_config
    )
    return {name for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


@pytest.mark.parametrize(
    ("config", "recipe"),
    [
        (TINY_T5, Recipe(batch_size=1, seq_len=8, target_len=4, quantize="nf4")),
        (TINY_VIT, Recipe(batch_size=1, quantize="nf4")),
    ],
    ids=["t5", "vit"],
)
def test_quantized_linears_are_the_ones_transformers_replaces(config, recipe, tmp_path):
    """T5's ``wo`` (``_keep_in_fp32_modules``) stays unquantized (before, it was packed, and
    T5's feed-forward cast its activations to the packed weight's uint8 and failed in
    dropout); ViT's classifier is quantized, as transformers 5 does (its last parameter is
    the bias, and only ``.weight`` is cut off the name)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    built = resolve(f"hf:{path}", recipe)
    ours = {name for name, m in built.model.named_modules() if isinstance(m, QuantizedLinear)}
    assert ours == transformers_quantized(config)
    estimate, _ = trace_and_estimate(built, recipe, "cpu")
    assert estimate.peak.allocated_bytes > 0


TINY_MIXTRAL = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
                "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                "num_attention_heads": 2, "num_key_value_heads": 1, "num_local_experts": 2,
                "vocab_size": 64, "max_position_embeddings": 64}  # fmt: skip


def test_lora_without_peft_default_targets_says_which_flag_to_pass(tmp_path, run_cli):
    """peft 0.21 wraps nothing by default in transformers 5's Mixtral (and has no default
    for Phi-3, Qwen2-MoE or LLaVA): its own error, and the flag that fixes it."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_MIXTRAL))
    code, _, err = run_cli("estimate", f"hf:{path}", "-s", "8", "--lora", "4")
    assert code == 2 and "peft cannot add LoRA adapters" in err and "--lora-targets" in err
    assert len(err.strip().splitlines()) == 1


def test_nf4_says_when_3d_expert_weights_stay_unquantized(tmp_path):
    """transformers 5's Mixtral experts are 3-D parameters: bitsandbytes' linear
    replacement leaves them in 16 bits (most of the weights), and the estimate says so;
    ``--experts linear`` (4.x's linears) quantizes them and needs no such note."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_MIXTRAL))
    fused = resolve(f"hf:{path}", Recipe(seq_len=8, quantize="nf4"))
    experts = sum(p.numel() for p in fused.model.parameters() if p.dim() == 3)
    assert experts == 3 * 2 * 32 * 64  # gate, up and down of 2 experts, 32 x 64 each
    assert any(f"leaves {experts:,} expert weights unquantized" in n for n in fused.notes)
    linear = resolve(f"hf:{path}", Recipe(seq_len=8, quantize="nf4", experts="linear"))
    assert not any("expert weights unquantized" in n for n in linear.notes)


def test_a_convolution_weight_is_not_called_an_expert_weight():
    """A vision tower's patch embedding is a convolution, whose weight has 4 dimensions:
    no expert weights are left unquantized there (Gemma 3 read 677,376 before)."""
    from torch import nn

    from vramplan.sources.finetune import _unreached_experts

    tower = nn.Sequential(nn.Conv2d(3, 8, 14, stride=14), nn.Flatten(), nn.Linear(8, 8))
    assert _unreached_experts(tower, "nf4") == []
    experts = nn.Module()
    experts.gate_up_proj = nn.Parameter(torch.zeros(2, 4, 8))
    assert "leaves 64 expert weights unquantized" in _unreached_experts(experts, "nf4")[0]
