"""Fine-tuning: LoRA through the real peft, frozen parameters, bitsandbytes' quantized
layouts. Ground truth: peft's own parameter counts, bitsandbytes' own quantized tensors
(on the CPU), and exact arithmetic over tiny configs."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import MID_LLAMA
from torch import nn

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

from vramplan import Recipe, UserError  # noqa: E402
from vramplan.pipeline import trace_and_estimate  # noqa: E402
from vramplan.result import Component, Phase  # noqa: E402
from vramplan.sources import resolve  # noqa: E402
from vramplan.sources.quantized import (  # noqa: E402
    QuantizedLinear,
    layout_4bit,
    layout_int8,
)

HIDDEN, INTER, VOCAB, LAYERS = 64, 128, 256, 2
TINY_LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": HIDDEN,
    "intermediate_size": INTER,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": VOCAB,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
# Per layer: q, k, v, o (64x64) and gate, up (128x64), down (64x128).
LINEARS = [(HIDDEN, HIDDEN)] * 4 + [(INTER, HIDDEN)] * 2 + [(HIDDEN, INTER)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("llama") / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return f"hf:{path}"


def traced(spec: str, recipe: Recipe):
    estimate, trace = trace_and_estimate(resolve(spec, recipe), recipe, "cpu")
    return estimate, trace


def bytes_of(trace, category: Component, iteration: int | None = None) -> int:
    return sum(
        a.nbytes
        for a in trace.allocations
        if a.category == category and (iteration is None or a.iteration == iteration)
    )


def live_state(trace) -> int:
    """Optimizer state alive at the end of the run (the ``step`` counters live on the host
    on CUDA; on the CPU they are 4-byte... so count only tensors of more than 8 bytes)."""
    return sum(
        a.nbytes
        for a in trace.allocations
        if a.category == Component.OPTIMIZER_STATE and a.free_index is None and a.nbytes > 8
    )


# -- LoRA ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_llama2_7b_lora_counts_equal_peft():
    """peft's print_trainable_parameters for Llama-2-7B, r=8 on q_proj and v_proj:
    trainable 4,194,304 of 6,742,609,920 (= 32 layers x 2 modules x 8 x (4096 + 4096))."""
    recipe = Recipe(lora_rank=8, lora_targets="q_proj,v_proj")
    model = resolve("hf:llama-2-7b", recipe).model
    assert isinstance(model, peft.PeftModel)
    trainable, total = model.get_nb_trainable_parameters()  # peft's own count
    assert (trainable, total) == (4_194_304, 6_742_609_920)
    assert trainable == 32 * 2 * 8 * (4096 + 4096)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == trainable


def test_lora_frozen_base_has_no_gradient_and_no_optimizer_state(llama):
    rank = 4
    recipe = Recipe(batch_size=2, seq_len=16, lora_rank=rank, lora_targets="q_proj,v_proj")
    estimate, trace = traced(llama, recipe)
    adapters = LAYERS * 2 * rank * (HIDDEN + HIDDEN)  # A (r x in) + B (out x r), q and v
    assert estimate.model.trainable_parameters == adapters
    # Gradients: exactly the adapters' fp32 bytes in each iteration, nothing for the base.
    assert bytes_of(trace, Component.GRADIENTS, iteration=1) == adapters * 4
    assert bytes_of(trace, Component.GRADIENTS, iteration=2) == adapters * 4
    # AdamW keeps exp_avg and exp_avg_sq for the adapters only.
    assert live_state(trace) == 2 * adapters * 4
    # The frozen base is still all there as parameters.
    total = estimate.model.parameters
    assert bytes_of(trace, Component.PARAMETERS) == total * 4


def test_peft_model_passed_to_the_python_api_matches_the_flag(llama):
    """A user's own PeftModel (built from the same config) traces like --lora does."""
    import transformers

    import vramplan

    config = transformers.LlamaConfig(
        **{k: v for k, v in TINY_LLAMA.items() if k not in ("model_type", "architectures")}
    )
    base = transformers.LlamaForCausalLM(config)
    user = peft.get_peft_model(
        base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    )
    ids = torch.randint(0, VOCAB, (2, 16))
    from_module = vramplan.estimate(
        user, example_batch={"input_ids": ids, "labels": ids}, target="cpu"
    )
    from_flag = vramplan.estimate(
        llama, batch_size=2, seq_len=16, lora_rank=4, lora_targets="q_proj,v_proj", target="cpu"
    )
    trainable, total = user.get_nb_trainable_parameters()
    assert from_module.model.trainable_parameters == trainable
    assert from_module.model.parameters == total
    for component in (Component.GRADIENTS, Component.OPTIMIZER_STATE, Component.PARAMETERS):
        assert from_module.components[component] == from_flag.components[component]
    # The same step; the user's batch holds its labels as a second tensor (+256 bytes).
    extra_input = from_module.details["input_bytes"] - from_flag.details["input_bytes"]
    assert extra_input == 2 * 16 * 8
    assert from_module.peak.allocated_bytes == from_flag.peak.allocated_bytes + extra_input
    assert all(p.device.type == "cpu" for p in user.parameters())  # the user's model untouched


def test_lora_dropout_keeps_a_mask_and_the_dropped_input(llama):
    """With lora_dropout > 0, peft feeds lora_A a dropped copy of the input: the copy (and
    its mask) are saved for backward, so activations grow."""
    base = dict(batch_size=2, seq_len=16, lora_rank=4, lora_targets="q_proj,v_proj")
    plain, _ = traced(llama, Recipe(**base))
    dropped, _ = traced(llama, Recipe(**base, lora_dropout=0.1))
    assert dropped.components[Component.ACTIVATIONS] > plain.components[Component.ACTIVATIONS]


# -- freezing ------------------------------------------------------------------------------


def test_train_only_and_freeze_patterns(llama):
    head = VOCAB * HIDDEN
    estimate, trace = traced(llama, Recipe(batch_size=2, seq_len=16, train_only="lm_head.*"))
    assert estimate.model.trainable_parameters == head
    assert bytes_of(trace, Component.GRADIENTS, iteration=2) == head * 4
    assert live_state(trace) == 2 * head * 4

    estimate, trace = traced(
        llama, Recipe(batch_size=2, seq_len=16, freeze="model.embed_tokens.*,lm_head.*")
    )
    frozen = 2 * head
    assert estimate.model.trainable_parameters == estimate.model.parameters - frozen
    trainable_bytes = (estimate.model.parameters - frozen) * 4
    assert bytes_of(trace, Component.GRADIENTS, iteration=2) == trainable_bytes
    assert live_state(trace) == 2 * trainable_bytes


def test_freezing_errors_are_user_errors(llama, run_cli):
    with pytest.raises(UserError, match="matches no parameter"):
        resolve(llama, Recipe(freeze="encoder.*"))
    with pytest.raises(UserError, match="no parameter is left to train"):
        resolve(llama, Recipe(freeze="*"))
    with pytest.raises(UserError, match="need --lora"):
        Recipe(lora_targets="q_proj")
    code, out, err = run_cli("estimate", llama, "--quantize", "nf3")
    assert code == 2 and err.count("\n") == 1 and "quantization" in err


# -- quantized layouts ---------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(4096, 4096), (11008, 4096), (65, 33)])
def test_4bit_layout_exact_arithmetic(shape):
    out_f, in_f = shape
    n = out_f * in_f
    blocks = -(-n // 64)
    plain = layout_4bit(out_f, in_f, double_quant=False)
    assert plain["weight"] == (((n + 1) // 2, 1), torch.uint8)  # two 4-bit values a byte
    assert plain["absmax"] == ((blocks,), torch.float32)
    double = layout_4bit(out_f, in_f, double_quant=True)
    assert double["absmax"] == ((blocks,), torch.uint8)
    assert double["absmax2"] == ((-(-blocks // 256),), torch.float32)
    layer = QuantizedLinear(nn.Linear(in_f, out_f, bias=False, device="meta"), "nf4")
    assert layer.stored_bytes() == (n + 1) // 2 + 4 * blocks + 16 * 4


def _bnb_functional():
    bnb = pytest.importorskip("bitsandbytes")
    return bnb.functional


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_4bit_layout_equals_bitsandbytes(quant_type, double_quant):
    """bitsandbytes' own quantize_4bit (what Params4bit calls) on a real CPU weight."""
    functional = _bnb_functional()
    out_f, in_f = 96, 80
    weight = torch.randn(out_f, in_f, dtype=torch.bfloat16)
    packed, state = functional.quantize_4bit(
        weight, blocksize=64, quant_type=quant_type, compress_statistics=double_quant
    )
    theirs = {"weight": packed, "absmax": state.absmax, "code": state.code}
    if double_quant:
        theirs.update(absmax2=state.state2.absmax, code2=state.state2.code, offset=state.offset)
    ours = layout_4bit(out_f, in_f, double_quant)
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert ours[name] == (tuple(tensor.shape), tensor.dtype), name
    layer = QuantizedLinear(
        nn.Linear(in_f, out_f, bias=False, device="meta"), quant_type, double_quant
    )
    assert layer.stored_bytes() == sum(t.numel() * t.element_size() for t in theirs.values())


def test_int8_layout_equals_bitsandbytes():
    functional = _bnb_functional()
    weight = torch.randn(96, 80, dtype=torch.float16)
    cb, scb, _ = functional.int8_vectorwise_quant(weight)
    ours = layout_int8(96, 80)
    assert ours["weight"] == (tuple(cb.shape), cb.dtype)
    assert ours["SCB"] == (tuple(scb.shape), scb.dtype)


def test_qlora_trace_stores_packed_weights_and_dequantizes_transiently(llama):
    """QLoRA on the tiny llama: parameters are the packed weights (+ full-precision
    embeddings, norms, head and adapters), the absmax statistics buffers; each quantized
    linear writes a transient bf16 copy of its weight in forward and again in backward,
    and none of those copies is kept for backward."""
    rank = 4
    recipe = Recipe(
        batch_size=1, seq_len=24, quantize="nf4", double_quant=True, lora_rank=rank,
        lora_targets="q_proj,v_proj", precision="amp-bf16",
    )  # fmt: skip
    estimate, trace = traced(llama, recipe)
    packed = sum((o * i + 1) // 2 for o, i in LINEARS) * LAYERS
    full = 2 * VOCAB * HIDDEN + (2 * LAYERS + 1) * HIDDEN  # embeddings, head, norms
    adapters = LAYERS * 2 * rank * 2 * HIDDEN
    assert bytes_of(trace, Component.PARAMETERS) == packed + 4 * (full + adapters)
    assert estimate.model.trainable_parameters == adapters
    assert estimate.model.parameters == full + adapters + LAYERS * sum(o * i for o, i in LINEARS)
    assert bytes_of(trace, Component.GRADIENTS, iteration=2) == adapters * 4
    assert live_state(trace) == 2 * adapters * 4
    # Transient dequantized weights, in bf16: one per quantized linear per pass.
    # Backward skips the first layer's q, k and v: their input (the normed, frozen
    # embeddings) needs no gradient, so MatMul4Bit computes no grad_A there.
    sizes = {o * i * 2 for o, i in LINEARS}
    expected = {Phase.FORWARD: LAYERS * len(LINEARS), Phase.BACKWARD: LAYERS * len(LINEARS) - 3}
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        dequantized = [
            a
            for a in trace.allocations
            if a.iteration == 2 and a.phase == phase and a.nbytes in sizes
            and a.category == Component.TEMPORARIES
        ]  # fmt: skip
        assert len(dequantized) == expected[phase], phase
    kept = [a for a in trace.allocations if a.category == Component.ACTIVATIONS]
    assert not [a for a in kept if a.nbytes in sizes and "proj" in (a.module or "")]


def test_gpt2_conv1d_layers_are_quantized_as_transformers_does(tmp_path):
    """GPT-2's linear layers are transformers' ``Conv1D`` (weight ``[in, out]``): bitsandbytes
    quantizes them as linears of the transposed shape, the output head kept. Exact
    arithmetic: each packed weight holds in*out/2 bytes, and peft puts r*(in+out) adapter
    parameters on each."""
    hidden, layers, rank = 64, 2, 4
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 256,
              "n_positions": 64, "n_embd": hidden, "n_layer": layers, "n_head": 2}  # fmt: skip
    path = tmp_path / "gpt2.json"
    path.write_text(json.dumps(config))
    recipe = Recipe(batch_size=1, seq_len=16, quantize="nf4", lora_rank=rank,
                    lora_targets="all-linear")  # fmt: skip
    built = resolve(f"hf:{path}", recipe)
    quantized = [m for m in built.model.modules() if isinstance(m, QuantizedLinear)]
    shapes = [(hidden, 3 * hidden), (hidden, hidden), (hidden, 4 * hidden), (4 * hidden, hidden)]
    assert sorted((m.in_features, m.out_features) for m in quantized) == sorted(shapes * layers)
    for m in quantized:
        assert m.weight.numel() == m.in_features * m.out_features // 2
        assert m.bias is not None and m.bias.shape == (m.out_features,)
    trainable = sum(p.numel() for p in built.model.parameters() if p.requires_grad)
    assert trainable == layers * sum(rank * (i + o) for i, o in shapes)
    estimate, _ = trace_and_estimate(built, recipe, "cpu")
    assert estimate.peak.allocated_bytes > 0


def test_quantized_statistics_keep_their_dtypes_under_bf16(llama):
    recipe = Recipe(batch_size=1, seq_len=8, quantize="nf4", lora_rank=2, precision="bf16")
    built = resolve(llama, recipe)
    from vramplan.trace.step import prepare_model_for

    prepare_model_for(built, recipe)
    layers = [m for m in built.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == LAYERS * len(LINEARS)  # every linear but lm_head
    assert all(m.absmax.dtype == torch.float32 and m.weight.dtype == torch.uint8 for m in layers)


def test_cli_qlora_json(llama, run_cli):
    code, out, err = run_cli(
        "estimate", llama, "--seq-len", "16", "--quantize", "nf4", "--double-quant",
        "--lora", "4", "--lora-targets", "all-linear", "--json",
    )  # fmt: skip
    assert code == 0, err
    data = json.loads(out)
    assert data["recipe"]["quantize"] == "nf4" and data["recipe"]["lora_rank"] == 4
    all_linear = LAYERS * rank_sum(4)
    assert data["model"]["trainable_parameters"] == all_linear


def test_qlora_build_leaves_bitsandbytes_unimported(llama):
    """peft wraps the modelled 4-bit layers without bitsandbytes (they are ``nn.Linear``
    subclasses): a QLoRA build in a fresh process does not import it and counts the
    adapters exactly; afterwards it is found installed, by peft too."""
    pytest.importorskip("bitsandbytes")
    import subprocess
    import sys

    code = f"""
import importlib.util, json, sys
from vramplan import Recipe
from vramplan.sources import resolve
model = resolve({llama!r}, Recipe(quantize="nf4", lora_rank=4, lora_targets="all-linear")).model
imported = "bitsandbytes" in sys.modules
from peft.import_utils import is_bnb_available
print(json.dumps({{
    "imported": imported,
    "installed": importlib.util.find_spec("bitsandbytes") is not None,
    "peft finds it": is_bnb_available(),
    "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
}}))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen == {
        "imported": False,
        "installed": True,
        "peft finds it": True,
        "trainable": LAYERS * rank_sum(4),
    }


def rank_sum(rank: int) -> int:
    """LoRA parameters of one layer's seven linears at ``rank``: r x (in + out) each."""
    return sum(rank * (o + i) for o, i in LINEARS)


def test_recipe_json_has_no_finetune_keys_unless_asked():
    assert "lora_rank" not in Recipe().to_json()
    assert Recipe(lora_rank=8).to_json()["lora_rank"] == 8


# -- the planner ---------------------------------------------------------------------------


@pytest.mark.slow
def test_plan_offers_lora_and_qlora_when_full_training_does_not_fit(tmp_path, run_cli):
    """A 340M-parameter llama on a 3 GiB card: full fine-tuning levers all OOM alone; LoRA
    and QLoRA are offered, QLoRA below LoRA below the baseline. Combined, the full
    fine-tuning levers fit (bf16 weights, 8-bit states, each gradient freed in backward),
    so the plan still trains every weight, and its flags run."""
    import vramplan

    path = tmp_path / "config.json"
    path.write_text(json.dumps(MID_LLAMA))
    answer = vramplan.plan(f"hf:{path}", gpu_memory="3GiB", batch_size=1, seq_len=128)
    levers = {lever.name: lever for lever in answer.levers.levers}
    lora, qlora = levers["LoRA"], levers["QLoRA"]
    assert lora.flags == "--lora 16 --lora-targets all-linear"
    assert qlora.flags == "--quantize nf4 --double-quant --lora 16 --lora-targets all-linear"
    per_layer = sum(16 * (o + i) for o, i in [(2048, 2048), (512, 2048), (512, 2048),
                    (2048, 2048), (5632, 2048), (5632, 2048), (2048, 5632)])  # fmt: skip
    assert lora.cost["trainable_parameters"] == qlora.cost["trainable_parameters"] == 4 * per_layer
    baseline = answer.levers.baseline.peak.device_total_bytes
    assert qlora.estimate.peak.device_total_bytes < lora.estimate.peak.device_total_bytes
    assert lora.estimate.peak.device_total_bytes < baseline
    plan = answer.levers.plan
    assert plan is not None and plan.status == "fits" and "--lora" not in plan.flags
    code, out, err = run_cli(
        "estimate", f"hf:{path}", "--gpu-memory", "3GiB", "--batch-size", "1", "--seq-len",
        "128", *plan.flags.split(),
    )  # fmt: skip
    assert code == 0, err
    assert "FITS" in out


def test_plan_offers_no_finetune_lever_when_the_baseline_fits(llama):
    import vramplan

    answer = vramplan.plan(llama, gpu="a100", batch_size=2, seq_len=16)
    assert answer.levers.baseline.verdict.status == "fits"
    assert not {"LoRA", "QLoRA"} & {lever.name for lever in answer.levers.levers}
