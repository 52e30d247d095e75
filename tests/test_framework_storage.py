"""How frameworks store and cast a fine-tuned model, traced. Ground truth: peft's own
``get_peft_model`` on a real CPU model, a real CPU run of transformers 4.48's loss (its
source, below) measured by PyTorch's profiler, and exact arithmetic."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_LLAMA, gqa_llama, hf_name
from torch.nn import functional as F  # noqa: N812

from vramplan import Recipe, UserError
from vramplan.measurement.run import measure_built
from vramplan.pipeline import trace_and_estimate
from vramplan.result import Component
from vramplan.sources import resolve
from vramplan.trace.storage import cast_parameters

BATCH, SEQ, VOCAB = 2, 64, TINY_LLAMA["vocab_size"]


def loss_4_48(logits, labels, vocab_size):
    """transformers 4.48.1 ``loss/loss_utils.py`` ``ForCausalLMLoss`` (mean reduction),
    as released: the shifted logits copied with ``.contiguous()``."""
    logits = logits.float()
    shift_logits = logits[..., :-1, :].contiguous()
    shift_labels = labels[..., 1:].contiguous()
    shift_logits = shift_logits.view(-1, vocab_size)
    shift_labels = shift_labels.view(-1)
    return F.cross_entropy(shift_logits, shift_labels, ignore_index=-100)


def test_shift_copy_loss_matches_a_real_run_of_transformers_4_48_loss(tiny_llama):
    """The traced peak with --loss-shift-copy equals a real CPU run of the whole model's
    forward followed by 4.48's loss (PyTorch's profiler) within 1%."""
    knobs = dict(batch_size=BATCH, seq_len=SEQ, optimizer="sgd", precision="bf16")
    recipe = Recipe(loss_shift_copy=True, **knobs)
    traced = trace_and_estimate(resolve(tiny_llama, recipe), recipe, "cpu")[0].peak.allocated_bytes
    plain = Recipe(**knobs)
    built = resolve(tiny_llama, plain, "cpu")

    def run(module, batch, training):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = module(**inputs).logits
        return loss_4_48(logits, batch["labels"], VOCAB) if training else logits

    built.run = run
    real = measure_built(built, plain, "cpu", steps=2).allocated_bytes
    assert abs(traced - real) <= 0.01 * real, (traced, real)


def loss_gpt_bigcode_4_48(logits, labels):
    """transformers 4.48.1 ``GPTBigCodeForCausalLM.forward``'s own loss: the shifted
    logits copied with ``.contiguous()`` in their own dtype, no upcast."""
    shift_logits = logits[..., :-1, :].contiguous()
    shift_labels = labels[..., 1:].contiguous()
    return torch.nn.CrossEntropyLoss()(
        shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1)
    )


def test_no_upcast_shift_copy_matches_a_real_run_of_gpt_bigcode_4_48_loss(tiny_llama):
    """--loss-shift-copy --loss-no-upcast: the traced peak equals a real CPU run of the
    forward followed by gpt_bigcode's 4.48 loss (bf16 throughout) within 1%, and lies
    below the upcasting loss's."""
    knobs = dict(batch_size=BATCH, seq_len=SEQ, optimizer="sgd", precision="bf16")
    recipe = Recipe(loss_shift_copy=True, loss_no_upcast=True, **knobs)
    traced = trace_and_estimate(resolve(tiny_llama, recipe), recipe, "cpu")[0].peak.allocated_bytes
    upcast = Recipe(loss_shift_copy=True, **knobs)
    upcast_peak = trace_and_estimate(resolve(tiny_llama, upcast), upcast, "cpu")[0]
    plain = Recipe(**knobs)
    built = resolve(tiny_llama, plain, "cpu")

    def run(module, batch, training):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = module(**inputs).logits
        return loss_gpt_bigcode_4_48(logits, batch["labels"]) if training else logits

    built.run = run
    real = measure_built(built, plain, "cpu", steps=2).allocated_bytes
    assert abs(traced - real) <= 0.01 * real, (traced, real)
    assert traced < upcast_peak.peak.allocated_bytes


def test_no_upcast_needs_the_shift_copy():
    with pytest.raises(UserError, match="--loss-no-upcast"):
        Recipe(loss_no_upcast=True)


def test_shift_copy_costs_one_fp32_copy_of_the_shifted_logits(tiny_llama):
    """In forward, at the loss of a bf16 model, the old loss holds the bf16 logits, their
    fp32 upcast, its shifted copy and the copy's log-softmax; today's the logits, the
    upcast and its log-softmax: one ``[batch, seq - 1, vocab]`` fp32 tensor more, one
    token's row less (labels aside)."""

    def forward_peak(**knobs) -> int:
        recipe = Recipe(batch_size=BATCH, seq_len=SEQ, optimizer="sgd", precision="bf16", **knobs)
        estimate = trace_and_estimate(resolve(tiny_llama, recipe), recipe, "cpu")[0]
        return estimate.phase_peaks["forward"]

    expected = BATCH * (SEQ - 1) * VOCAB * 4 - BATCH * VOCAB * 4
    labels = 2 * BATCH * SEQ * 8  # the int64 shifted labels each path makes
    assert abs(forward_peak(loss_shift_copy=True) - forward_peak() - expected) <= labels


def test_shift_copy_conflicts_with_replaced_losses():
    with pytest.raises(UserError, match="--loss-shift-copy"):
        Recipe(loss_shift_copy=True, loss_chunks=4)


def test_peft_adapters_in_a_bf16_model_are_fp32_as_peft_makes_them(tiny_llama):
    """``--precision amp-bf16 --weights-dtype bf16 --keep-fp32 '*lora_*'`` stores what
    peft's ``get_peft_model`` leaves on a real bf16 model: base weights bf16, adapters fp32
    (``autocast_adapter_dtype=True``); the optimizer state follows the fp32 adapters."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"})
    real = peft.get_peft_model(
        transformers.LlamaForCausalLM(config).to(torch.bfloat16),
        peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )
    real_dtypes = {n: p.dtype for n, p in real.named_parameters()}
    recipe = Recipe(
        batch_size=BATCH,
        seq_len=SEQ,
        precision="amp-bf16",
        weights_dtype="bf16",
        keep_fp32="*lora_*",
        lora_rank=4,
        lora_targets="q_proj,v_proj",
    )
    built = resolve(tiny_llama, recipe)
    cast_parameters(built.model, recipe)
    assert {n: p.dtype for n, p in built.model.named_parameters()} == real_dtypes
    estimate = trace_and_estimate(resolve(tiny_llama, recipe), recipe, "cpu")[0]
    adapters = sum(p.numel() * 4 for n, p in real.named_parameters() if p.requires_grad)
    assert estimate.components[Component.OPTIMIZER_STATE] == 2 * adapters  # AdamW: 2 fp32


def test_weights_dtype_needs_autocast_and_patterns_must_match(tiny_llama):
    with pytest.raises(UserError, match="amp-bf16"):
        Recipe(precision="bf16", weights_dtype="bf16")
    recipe = Recipe(precision="bf16", keep_fp32="*nothing_like_this*")
    with pytest.raises(UserError, match="matches no parameter"):
        cast_parameters(resolve(tiny_llama, recipe).model, recipe)


# -- repeated blocks of a LoRA model ---------------------------------------------------------


def test_lora_blocks_repeat_exactly(tmp_path, monkeypatch):
    """Only the blocks train, so the optimizer's per-block temporaries and zero_grad's
    per-block gradients meet: the repeated trace still equals the full one event for event
    (before, LoRA models were traced whole)."""
    from vramplan.device.options import device_options
    from vramplan.trace.repeat import same_events

    pytest.importorskip("peft")
    monkeypatch.setattr("vramplan.trace.repeat.MIN_BLOCKS", 5)  # a speed policy
    path = tmp_path / "llama6.json"
    path.write_text(json.dumps({**TINY_LLAMA, "num_hidden_layers": 6, "vocab_size": 256}))
    recipe = Recipe(  # fms's QLoRA rows as TRL prepares them, transformers 4.48's loss
        batch_size=BATCH,
        seq_len=16,
        precision="amp-bf16",
        weights_dtype="bf16",
        keep_fp32="*lora_*,*norm*",
        checkpointing="full",
        quantize="nf4",
        double_quant=True,
        lora_rank=4,
        lora_targets="q_proj,v_proj",
        lora_dropout=0.1,
        loss_shift_copy=True,
    )
    results = []
    for repeat in (False, True):
        built = resolve(f"hf:{path}", recipe)
        built.repeat_blocks = repeat
        results.append(trace_and_estimate(built, recipe, "cuda", device_options(gpu="a100-80gb")))
    (full, full_trace), (repeated, repeated_trace) = results
    assert any(n.startswith("repeated blocks: traced 2 and 3") for n in repeated.notes)
    assert repeated.peak.allocated_bytes == full.peak.allocated_bytes
    assert repeated.phase_peaks == full.phase_peaks
    assert same_events(repeated_trace, full_trace)


# -- the storage flags on max-batch and plan -------------------------------------------------


def test_max_batch_with_the_shift_copy_stops_where_the_copy_no_longer_fits(tiny_llama, run_cli):
    """``max-batch --loss-shift-copy`` searches the step with the old loss's copy: its answer
    N is traced with the copy (N + 1 does not fit), and it is smaller than without the flag
    (the plain step at N + 1 still fits)."""
    import vramplan

    knobs = dict(seq_len=SEQ, precision="bf16", gpu_memory="1800MiB")
    args = ["--seq-len", str(SEQ), "--precision", "bf16", "--gpu-memory", "1800MiB"]
    code, out, err = run_cli("max-batch", tiny_llama, *args, "--loss-shift-copy", "--json")
    assert code == 0, err
    answer = json.loads(out)
    largest = answer["max_batch_size"]
    assert answer["estimate"]["recipe"]["loss_shift_copy"] is True
    assert answer["next"]["status"] != "fits"
    with_copy = vramplan.estimate(tiny_llama, batch_size=largest, loss_shift_copy=True, **knobs)
    assert answer["estimate"]["peak"] == with_copy.peak.to_json()
    plain = vramplan.estimate(tiny_llama, batch_size=largest + 1, **knobs)
    assert plain.verdict.status == "fits"


def test_plan_stores_weights_as_the_storage_flags_say(tiny_llama, run_cli):
    """``plan --weights-dtype bf16 --keep-fp32 '*norm*'``: the planned step's weights are
    bf16 but for the RMSNorm weights, byte for byte (without the flags: fp32 all through)."""
    args = ["--seq-len", "16", "--optimizer", "sgd", "--gpu-memory", "1800MiB", "--json"]
    storage = ["--precision", "amp-bf16", "--weights-dtype", "bf16", "--keep-fp32", "*norm*"]
    code, out, err = run_cli("plan", tiny_llama, *args, *storage)
    assert code == 0, err
    model = json.loads(out)["estimate"]["model"]
    hidden, layers = TINY_LLAMA["hidden_size"], TINY_LLAMA["num_hidden_layers"]
    norms = (2 * layers + 1) * hidden  # two per block and the final one
    assert model["parameter_bytes"] == 2 * (model["parameters"] - norms) + 4 * norms
    assert model["parameter_bytes"] != 4 * model["parameters"]


TINY_BIGCODE = {
    "model_type": "gpt_bigcode",
    "architectures": ["GPTBigCodeForCausalLM"],
    "multi_query": True,
    "n_embd": 64,
    "n_head": 4,
    "n_inner": 128,
    "n_layer": 3,
    "n_positions": 128,
    "vocab_size": 2048,
    "use_cache": True,
    "attn_pdrop": 0.0,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
}


@pytest.fixture(scope="module")
def tiny_bigcode(tmp_path_factory) -> str:
    pytest.importorskip("transformers")
    return hf_name(tmp_path_factory.mktemp("bigcode"), TINY_BIGCODE)


def test_kv_in_training_keeps_each_blocks_fused_projection_until_the_loss(tiny_bigcode):
    """transformers 4.48's gpt_bigcode under checkpointing: the forward's peak (at the
    loss) holds every block's ``c_attn`` output (``[batch, seq, n_embd + 2 x head_dim]``,
    multi-query) more, to the byte; backward, after the model's output is gone, holds
    nothing more."""

    def peaks(**knobs) -> dict[str, int]:
        recipe = Recipe(
            batch_size=BATCH,
            seq_len=SEQ,
            optimizer="sgd",
            precision="bf16",
            checkpointing="full",
            loss_shift_copy=True,
            loss_no_upcast=True,
            **knobs,
        )
        return trace_and_estimate(resolve(tiny_bigcode, recipe), recipe, "cpu")[0].phase_peaks

    head_dim = TINY_BIGCODE["n_embd"] // TINY_BIGCODE["n_head"]
    per_block = BATCH * SEQ * (TINY_BIGCODE["n_embd"] + 2 * head_dim) * 2
    kept, plain = peaks(kv_in_training=True), peaks()
    assert kept["forward"] - plain["forward"] == TINY_BIGCODE["n_layer"] * per_block
    assert kept["backward"] == plain["backward"]


def test_kv_in_training_is_gpt_bigcodes_and_a_training_steps(tiny_llama, tiny_bigcode):
    with pytest.raises(UserError, match="--kv-in-training .* llama"):
        resolve(tiny_llama, Recipe(kv_in_training=True))
    with pytest.raises(UserError, match="does not train"):
        resolve(tiny_bigcode, Recipe(kv_in_training=True, mode="infer"))


@pytest.mark.parametrize("knobs", [{"loss_chunks": 4}, {"loss_shift_copy": True}])
def test_a_replaced_loss_calls_the_model_as_its_own_loss_does(tiny_llama, monkeypatch, knobs):
    """Under checkpointing (no cache) transformers 5 looks for packed sequences in the
    position ids; a real run of one sequence per row finds none and builds no causal mask
    (SDPA's is_causal). The traced step with a replaced loss builds none either, as with
    the model's own loss."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama

    masks: list = []
    build = modeling_llama.create_causal_mask

    def spy(*args, **kwargs):
        mask = build(*args, **kwargs)
        masks.append(None if mask is None else tuple(mask.shape))
        return mask

    monkeypatch.setattr(modeling_llama, "create_causal_mask", spy)
    config = transformers.LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"})
    real = transformers.LlamaForCausalLM(config).train()
    real.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    real(input_ids=ids, labels=ids).loss.backward()
    assert masks == [None]
    masks.clear()
    recipe = Recipe(batch_size=BATCH, seq_len=SEQ, optimizer="sgd", checkpointing="full", **knobs)
    trace_and_estimate(resolve(tiny_llama, recipe), recipe, "cpu")
    assert masks and set(masks) == {None}


TINY_GQA = {**gqa_llama(2), "num_attention_heads": 8}


def test_repeat_kv_saves_k_and_v_repeated_to_every_head(tmp_path):
    """``--repeat-kv`` (transformers < 4.54, torchtune): without checkpointing each layer's
    SDPA saves K and V repeated to all query heads instead of the key/value heads' own, so
    backward starts ``layers x 2 x (heads - kv_heads) x batch x seq x head_dim`` bf16 bytes
    higher; with every block recomputed, the recomputation in backward repeats them as the
    forward did (more query-head-sized tensors made in backward)."""
    pytest.importorskip("transformers")
    name = hf_name(tmp_path, TINY_GQA)
    heads, kv_heads = TINY_GQA["num_attention_heads"], TINY_GQA["num_key_value_heads"]
    head_dim = TINY_GQA["hidden_size"] // heads

    def traced(checkpointing: str, repeat_kv: bool):
        recipe = Recipe(
            batch_size=BATCH,
            seq_len=SEQ,
            precision="bf16",
            optimizer="sgd",
            checkpointing=checkpointing,
            repeat_kv=repeat_kv,
        )
        return trace_and_estimate(resolve(name, recipe), recipe, "cuda")

    repeated, own = traced("none", True)[0].phase_peaks, traced("none", False)[0].phase_peaks
    per_layer = 2 * (heads - kv_heads) * BATCH * SEQ * head_dim * 2
    assert repeated["backward"] - own["backward"] == TINY_GQA["num_hidden_layers"] * per_layer

    def head_sized_in_backward(repeat_kv: bool) -> int:
        trace = traced("full", repeat_kv)[1]
        size = BATCH * heads * SEQ * head_dim * 2
        return sum(1 for a in trace.allocations if a.phase == "backward" and a.nbytes == size)

    assert head_sized_in_backward(True) > head_sized_in_backward(False)


def test_repeat_kv_says_where_it_changes_nothing(tiny_llama, tmp_path):
    """A model without grouped-query attention, or eager attention (which repeats K and V
    itself): the flag is noted as changing nothing, and the figures are the plain ones."""
    knobs = dict(batch_size=BATCH, seq_len=SEQ, optimizer="sgd")
    built = resolve(tiny_llama, Recipe(repeat_kv=True, **knobs))
    assert any("no grouped-query attention" in n for n in built.notes)
    name = hf_name(tmp_path, TINY_GQA)
    eager = Recipe(repeat_kv=True, attention="eager", **knobs)
    built = resolve(name, eager)
    assert any("eager attention takes K and V" in n for n in built.notes)
    plain = Recipe(attention="eager", **knobs)
    repeated = trace_and_estimate(built, eager, "cpu")[0].peak.allocated_bytes
    own = trace_and_estimate(resolve(name, plain), plain, "cpu")[0].peak.allocated_bytes
    assert repeated == own
