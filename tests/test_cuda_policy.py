"""CUDA's autocast rules on CPU tensors: the op lists of autocast_mode.cpp (AutocastCUDA),
checked against the installed PyTorch's registrations and against the CPU's own lists."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vramplan.recipe import Recipe
from vramplan.sources.user_code import module_source
from vramplan.trace.cuda_autocast import cuda_autocast, policy_of, registered_ops
from vramplan.trace.policy import CpuPolicy, CudaPolicy
from vramplan.trace.step import trace_training


def test_every_installed_cuda_autocast_op_gets_a_policy():
    cuda_ops, cpu_only = registered_ops()
    assert "aten::layer_norm" in cuda_ops and "aten::mm" in cuda_ops
    assert "aten::cat" in cpu_only  # the CPU promotes cat; CUDA does not list it
    policies = {policy_of(name) for name in cuda_ops}
    assert policies <= {"lower", "fp32", "fp32_set_opt_dtype", "promote", "banned"}


@pytest.mark.parametrize(
    "name,policy",
    [
        ("aten::linear", "lower"),
        ("aten::conv2d", "lower"),
        ("aten::bmm", "lower"),
        ("aten::baddbmm", "lower"),
        ("aten::einsum", "lower"),
        ("aten::layer_norm", "fp32"),
        ("aten::group_norm", "fp32"),
        ("aten::exp", "fp32"),
        ("aten::nll_loss", "fp32"),
        ("aten::softmax.int", "fp32_set_opt_dtype"),
        ("aten::log_softmax.int", "fp32_set_opt_dtype"),
        ("aten::sum", "fp32_set_opt_dtype"),
        ("aten::cumsum", "fp32_set_opt_dtype"),
        ("aten::addcmul", "promote"),
        ("aten::binary_cross_entropy", "banned"),
    ],
)
def test_policies_from_autocast_mode_cpp(name, policy):
    assert policy_of(name) == policy


def _outputs(autocast):
    torch.manual_seed(0)
    linear, norm = nn.Linear(16, 16), nn.LayerNorm(16)
    x = torch.randn(4, 16)
    with autocast:
        hidden = linear(x)
        return hidden.dtype, norm(hidden).dtype, torch.softmax(hidden, -1).dtype, hidden.sum().dtype


def test_cuda_rules_differ_from_the_cpu_lists():
    assert _outputs(cuda_autocast(torch.float16)) == (
        torch.float16,
        torch.float32,
        torch.float32,
        torch.float32,
    )
    cpu = _outputs(torch.autocast("cpu", dtype=torch.float16))
    assert cpu == (torch.float16, torch.float16, torch.float16, torch.float16)


def test_registration_is_removed_after_the_region():
    with cuda_autocast(torch.bfloat16):
        pass
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert nn.functional.layer_norm(x.bfloat16(), (16,)).dtype == torch.bfloat16


class SharedWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(256, 256, bias=False)

    def forward(self, x):
        return self.proj(torch.relu(self.proj(x)))


def _weight_casts(policy) -> int:
    recipe = Recipe(batch_size=8, precision="amp-fp16", optimizer="sgd")
    with torch.device("meta"):
        model = SharedWeight()
    built = module_source(model, recipe.with_changes(input_shape=(256,)), "shared")
    trace = trace_training(built, recipe, policy)
    return sum(
        1
        for a in trace.allocations
        if a.op == "_to_copy" and a.nbytes == 256 * 256 * 2 and a.phase == "forward"
    )


def test_weight_cast_cache_one_copy_per_region():
    # two uses of one weight per forward, two iterations: one fp16 copy per region
    assert _weight_casts(CudaPolicy()) == 2


def test_amp_trace_runs_backward_under_cuda_rules(gpt2_config):

    from vramplan.pipeline import estimate_built
    from vramplan.sources import resolve

    # no dropout: both devices run a fused attention kernel, so the difference is the
    # autocast lists alone
    path = gpt2_config(no_dropout=True)
    recipe = Recipe(batch_size=2, seq_len=32, precision="amp-bf16")
    cuda = estimate_built(resolve(f"hf:{path}", recipe), recipe, "cuda")
    cpu = estimate_built(resolve(f"hf:{path}", recipe), recipe, "cpu")
    # fp32 layer norms and softmaxes keep more activation bytes than the CPU's bf16 ones
    assert cuda.details["tensor_components"]["activations"] > cpu.components["activations"]
    assert cuda.components["gradients"] >= 0 and cuda.peak.phase in ("forward", "backward")
    assert isinstance(CpuPolicy().autocast(recipe), torch.autocast)


def test_amp_with_checkpointing_recomputes_under_the_same_rules(tiny_gpt2_config):

    from vramplan.pipeline import estimate_built
    from vramplan.sources import resolve

    path = tiny_gpt2_config
    plain = Recipe(batch_size=2, seq_len=32, precision="amp-bf16")
    checkpointed = plain.with_changes(checkpointing="full")
    full = estimate_built(resolve(f"hf:{path}", checkpointed), checkpointed, "cuda")
    base = estimate_built(resolve(f"hf:{path}", plain), plain, "cuda")
    assert (
        full.details["tensor_components"]["activations"]
        < base.details["tensor_components"]["activations"]
    )


def test_recompute_casts_do_not_outlive_their_block(gpt2_config):
    """A checkpoint's recompute enters and leaves autocast once per block; PyTorch empties
    the weight-cast cache on leaving, so no half-precision weight copy reaches the
    optimizer step: its phase holds what the fp32 run's holds."""

    from vramplan.sources import resolve
    from vramplan.trace.summary import summarize_trace

    path = gpt2_config(n_embd=64)

    def optimizer_phase(precision):
        recipe = Recipe(batch_size=2, seq_len=32, precision=precision, checkpointing="full")
        trace = trace_training(resolve(f"hf:{path}", recipe), recipe, CudaPolicy())
        return summarize_trace(trace).phase_components["optimizer"]

    amp, fp32 = optimizer_phase("amp-bf16"), optimizer_phase("fp32")
    assert sum(amp.values()) == sum(fp32.values())
