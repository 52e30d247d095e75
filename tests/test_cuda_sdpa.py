"""Attention as a GPU runs it: PyTorch's SDPA selection rules (sdp_utils.cpp), and what
the chosen kernel keeps for backward, checked against the CPU's own fused kernel."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from vramplan.device.stack import parse_stack
from vramplan.recipe import Recipe
from vramplan.sources import resolve
from vramplan.trace.cuda_sdpa import Attention, choose_backend, cuda_sdpa
from vramplan.trace.policy import CpuPolicy, CudaPolicy
from vramplan.trace.step import trace_training
from vramplan.trace.summary import summarize_trace


def _shape(
    dtype=torch.bfloat16,
    head=64,
    heads_kv=8,
    mask=False,
    dropout=0.1,
    grad=True,
    causal=False,
    len_q=512,
    len_kv=512,
):
    return Attention(dtype, head, head, 8, heads_kv, len_q, len_kv, mask, dropout, causal, grad)


@pytest.mark.parametrize(
    "shape,arch,backend",
    [
        (_shape(), "sm80", "flash"),  # half precision, no mask: flash (dropout inside)
        (_shape(mask=True), "sm80", "efficient"),  # flash takes no arbitrary mask
        (_shape(dtype=torch.float32), "sm80", "efficient"),  # flash is half-only
        (_shape(dtype=torch.float16), "sm75", "efficient"),  # flash needs sm80
        (_shape(dtype=torch.bfloat16), "sm75", "math"),  # no bf16 kernel before sm80
        (_shape(dtype=torch.float32, heads_kv=2), "sm80", "math"),  # GQA: not efficient
        (_shape(heads_kv=2), "sm80", "flash"),  # flash takes GQA
        (_shape(dropout=0.0), "sm90", "cudnn"),  # cuDNN first on sm90
        (_shape(dropout=0.125), "sm90", "cudnn"),  # a dropout in 1/16 steps
        (_shape(), "sm90", "flash"),  # 0.1 is not in cuDNN's 1/16 steps
        (_shape(mask=True), "sm90", "efficient"),  # flash takes no mask
        (_shape(head=256, dropout=0.0), "sm90", "cudnn"),  # up to 256 on sm90
        (_shape(head=256), "sm100", "flash"),  # cuDNN up to 128 elsewhere
        (_shape(head=200), "sm86", "efficient"),  # flash backward: no (192, 224] on sm86
        (_shape(head=200, grad=False), "sm86", "flash"),  # inference is fine
        (_shape(causal=True, len_q=1, len_kv=512), "sm80", "efficient"),  # non-square causal
        (_shape(head=100, dtype=torch.float16), "sm80", "flash"),  # flash pads to 8
        (_shape(head=100, dtype=torch.float16), "sm75", "math"),  # efficient needs /8
        (_shape(), "gfx942", "flash"),
    ],
)
def test_selection_rules(shape, arch, backend):
    assert choose_backend(shape, arch) == backend


def test_before_pytorch_2_12_cudnn_takes_any_dropout():
    """A lent H200 (torch 2.11, cuDNN 9.19) ran BERT's and GPT-2's 0.1 dropout on cuDNN."""
    assert choose_backend(_shape(), "sm90", dropout_steps=False) == "cudnn"
    assert parse_stack("torch2.11-cu13.0").cudnn_dropout_steps is False
    assert parse_stack("torch2.14-cu13.0").cudnn_dropout_steps is True


@pytest.mark.parametrize("arch", ["sm80", "sm90"])
def test_a_learned_bias_runs_on_the_math_kernel(arch):
    """What torch._fused_sdp_choice picked for flan-t5's self-attention on the H200."""
    assert choose_backend(replace(_shape(mask=True), mask_needs_grad=True), arch) == "math"


def _qkv(length, dtype=torch.bfloat16):
    return [torch.randn(2, 4, length, 64, dtype=dtype, requires_grad=True) for _ in range(3)]


def test_chosen_kernels_keep_their_log_sum_exp_not_the_matrix():
    """Under fake tensors: flash keeps out + one fp32 log-sum-exp per row; math keeps the
    (L, L) probabilities. Exact arithmetic on what autograd saved."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def saved_bytes(arch, dtype):
        with FakeTensorMode(), cuda_sdpa(arch, {}):
            q, k, v = _qkv(256, dtype)
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
            seen, total = set(), 0
            node, stack = out.grad_fn, [out.grad_fn]
            while stack:
                node = stack.pop()
                if node is None or id(node) in seen:
                    continue
                seen.add(id(node))
                for name in dir(node):
                    if name.startswith("_saved_"):
                        value = getattr(node, name)
                        if isinstance(value, torch.Tensor) and value.numel() > 1:
                            total += value.numel() * value.element_size()
                stack += [n for n, _ in node.next_functions]
            return total

    qkv_out = 4 * 2 * 4 * 256 * 64 * 2  # q, k, v and the output in bf16
    lse = 2 * 4 * 256 * 4  # fp32, one per row
    rng_state = 2 * 8  # dropout's philox seed and offset
    assert saved_bytes("sm80", torch.bfloat16) == qkv_out + lse + rng_state
    assert saved_bytes("sm75", torch.bfloat16) > 2 * 4 * 256 * 256 * 2  # math: (L, L)


@pytest.fixture(scope="module")
def gpt2_spec(gpt2_config):
    return f"hf:{gpt2_config(no_dropout=True, n_positions=512, n_embd=128, n_head=4)}"


def _forward_activations(spec, policy, seq_len, checkpointing="none"):
    recipe = Recipe(
        batch_size=2,
        seq_len=seq_len,
        precision="bf16",
        optimizer="sgd",
        checkpointing=checkpointing,
    )
    trace = trace_training(resolve(spec, recipe), recipe, policy)
    return summarize_trace(trace).phase_components["forward"]["activations"], trace


def test_cuda_flash_keeps_what_the_cpu_fused_kernel_keeps(gpt2_spec):
    # without dropout the CPU runs its own fused flash kernel, whose saved tensors PyTorch
    # instruments on real CPU runs (tests/test_ground_truth.py); CUDA's flash keeps the same
    cpu, _ = _forward_activations(gpt2_spec, CpuPolicy(), 256)
    cuda, trace = _forward_activations(gpt2_spec, CudaPolicy("sm80"), 256)
    assert cuda == pytest.approx(cpu, rel=0.01)
    assert trace.op_counts[("forward", "_scaled_dot_product_flash_attention")] == 2 * 2
    assert ("forward", "_safe_softmax") not in trace.op_counts


def test_recompute_under_checkpointing_uses_the_same_kernel(gpt2_spec):
    _, trace = _forward_activations(gpt2_spec, CudaPolicy("sm80"), 128, checkpointing="full")
    kernels = {
        op: n
        for (phase, op), n in trace.op_counts.items()
        if phase == "forward" and op.startswith("_scaled_dot_product")
    }
    assert len(kernels) == 1 and "math" not in next(iter(kernels))
    ((kernel, calls),) = kernels.items()
    assert trace.op_counts[("backward", kernel)] == calls == 2 * 2  # recomputed, same kernel
    assert ("backward", "_safe_softmax") not in trace.op_counts


def test_f_is_restored_after_tracing(gpt2_spec):
    original = F.scaled_dot_product_attention
    _forward_activations(gpt2_spec, CudaPolicy("sm90"), 64)
    assert F.scaled_dot_product_attention is original


def _t5(tmp_path, dropout: float) -> str:
    config = {
        "architectures": ["T5ForConditionalGeneration"],
        "model_type": "t5",
        "d_model": 64,
        "d_kv": 16,
        "d_ff": 128,
        "num_layers": 2,
        "num_decoder_layers": 2,
        "num_heads": 4,
        "vocab_size": 128,
        "dropout_rate": dropout,
        "decoder_start_token_id": 0,
        "pad_token_id": 0,
    }
    path = tmp_path / f"t5-{dropout}" / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(config))
    return f"hf:{path}"


@pytest.mark.parametrize(
    "dropout,stack,cross",
    [(0.1, "torch2.11-cu13.0", "cudnn"), (0.1, "torch2.14-cu13.0", "efficient")],
)
def test_t5_kernels_are_those_a_real_h200_step_picked(tmp_path, run_cli, dropout, stack, cross):
    """flan-t5 on a lent H200 (torch 2.11): math for the self-attention, whose learned
    position bias needs a gradient, and cuDNN for the cross-attention (a mask without one,
    dropout 0.1). From PyTorch 2.12 cuDNN refuses 0.1, so the cross-attention runs on
    memory-efficient attention (flash takes no mask). Two blocks each side, two iterations."""
    args = ("-s", "32", "-p", "fp16", "--gpu", "h200", "--stack", stack, "--json")
    code, out, _ = run_cli("estimate", _t5(tmp_path, dropout), *args)
    notes = [n for n in json.loads(out)["notes"] if "SDPA selection" in n]
    assert code == 0 and notes == [
        f"attention as the GPU runs it (PyTorch's SDPA selection): {cross} x4, math x8"
    ]


def test_math_kernel_keeps_cudas_one_byte_dropout_mask():
    """On CUDA the math kernel's dropout is ``native_dropout``: backward keeps a bool mask of
    the (B, H, L, S) probabilities beside the softmax output and the dropped probabilities
    (both fp32 after the half-precision upcast); the CPU's unfused dropout would keep a
    third fp32 tensor of that size (its noise) instead of the mask."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    shape = (2, 4, 64, 64)  # (B, H, L, S)
    saved = []
    with FakeTensorMode(), cuda_sdpa("sm90", {}):
        q, k, v = _qkv(64)
        q, k, v = (t[..., :16] for t in (q, k, v))
        bias = torch.zeros(1, 4, 64, 64, dtype=torch.bfloat16, requires_grad=True)  # learned
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append((tuple(t.shape), t.dtype)) or t, lambda t: t
        ):
            F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=0.1)
    flat = [(math.prod(s), d) for s, d in saved]
    n = math.prod(shape)
    assert flat.count((n, torch.bool)) == 1
    assert flat.count((n, torch.float32)) == 2
