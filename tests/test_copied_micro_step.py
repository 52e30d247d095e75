"""The second micro-step of gradient accumulation written from the first: the trace equals
one whose second micro-step ran, allocation for allocation, and a first micro-step that
leaves more than its gradients behind, or whose gradients PyTorch copied, is followed by a
traced second one."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import PLAN_LLAMA as LLAMA
from conftest import TINY_GPT2 as GPT2
from conftest import TINY_UNET, Remembering, hf_builder, meta_built
from torch import nn

from vramplan.recipe import Recipe
from vramplan.sources import resolve
from vramplan.trace import copied_micro_step, step
from vramplan.trace.flops import FlopCountingPolicy
from vramplan.trace.policy import CpuPolicy, CudaPolicy
from vramplan.trace.step import trace_training


@pytest.fixture
def written(monkeypatch) -> list[tuple[bool, str]]:
    """Whether each second micro-step was written, and why not."""
    answers: list[tuple[bool, str]] = []
    copies = copied_micro_step.MicroStepCopy.copies

    def watched(self, iteration: int, micro_step: int) -> bool:
        copied = copies(self, iteration, micro_step)
        if micro_step == 1:
            answers.append((copied, self.reason))
        return copied

    monkeypatch.setattr(copied_micro_step.MicroStepCopy, "copies", watched)
    return answers


def _ran_and_written(monkeypatch, make_built, recipe: Recipe, policy_type=CudaPolicy):
    """(trace, policy) with the second micro-step run, then written (the second iteration
    copied in both, ``copied_iteration.py``)."""
    results = []
    for write in (False, True):
        allowed = copied_micro_step.micro_steps_copyable if write else lambda *_, **__: False
        monkeypatch.setattr(step, "micro_steps_copyable", allowed)
        policy = policy_type()
        results.append((trace_training(make_built(), recipe, policy), policy))
    return results


@pytest.mark.parametrize(
    ("config", "knobs"),
    [
        (GPT2, {"grad_accum": 2}),  # a tied head: one accumulation of two gradients
        (GPT2, {"grad_accum": 2, "precision": "amp-fp16"}),
        (LLAMA, {"grad_accum": 4, "precision": "amp-bf16", "optimizer": "sgd"}),
        (LLAMA, {"grad_accum": 2, "checkpointing": "full", "lora_rank": 4}),
        (LLAMA, {"grad_accum": 2, "precision": "bf16", "optimizer": "adam8bit", "loss_chunks": 4}),
        (LLAMA, {"grad_accum": 2, "precision": "bf16", "quantize": "nf4", "lora_rank": 4}),
        (LLAMA, {"grad_accum": 3, "optimizer": "adafactor", "checkpointing": "1"}),
    ],
)
def test_written_micro_step_equals_a_run_one(tmp_path, monkeypatch, written, config, knobs):
    recipe = Recipe(batch_size=2, seq_len=32, **knobs)
    built = hf_builder(tmp_path, config, recipe)
    (ran, _), (copied, _) = _ran_and_written(monkeypatch, built, recipe)
    assert written == [(True, "")]  # (the first run offers no copy)
    assert copied == ran  # every allocation, phase mark, op count, note and marker
    passes = [m for m in copied.phases if m.iteration == 1 and m.phase == "forward"]
    assert len(passes) >= 2  # both micro-steps are in the trace


def test_written_micro_step_keeps_flops_and_convolution_markers(monkeypatch, written):
    recipe = Recipe(batch_size=2, input_shape=(3, 64, 64), optimizer="sgd", grad_accum=2)
    resnet = lambda: resolve("torchvision:resnet18", recipe)  # noqa: E731
    (ran, counted), (copied, recounted) = _ran_and_written(
        monkeypatch, resnet, recipe, FlopCountingPolicy
    )
    assert written == [(True, "")]
    assert copied == ran
    assert recounted.counter.get_total_flops() == counted.counter.get_total_flops() > 0


def test_written_micro_step_of_a_diffusion_unet(tmp_path, monkeypatch, written):
    """Noise, timesteps and text embeddings drawn per micro-step; group norms, convolutions
    and cross-attention under amp-fp16 with every block recomputed."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_UNET))
    recipe = Recipe(batch_size=2, grad_accum=2, precision="amp-fp16", checkpointing="full")
    unet = lambda: resolve(f"diffusers:{tmp_path}", recipe)  # noqa: E731
    (ran, _), (copied, _) = _ran_and_written(monkeypatch, unet, recipe)
    assert written == [(True, "")]
    assert copied == ran


def test_cpu_kernel_notes_count_the_written_micro_step(monkeypatch, written):
    recipe = Recipe(batch_size=2, input_shape=(3, 32, 32), optimizer="sgd", grad_accum=2)
    resnet = lambda: resolve("torchvision:resnet18", recipe)  # noqa: E731
    (ran, _), (copied, policy) = _ran_and_written(monkeypatch, resnet, recipe, CpuPolicy)
    assert written == [(True, "")]
    assert copied == ran and policy.trace_notes() == list(ran.notes)


def test_gradients_kept_by_zero_grad_leave_the_second_iteration_traced(
    tmp_path, monkeypatch, written
):
    recipe = Recipe(batch_size=2, seq_len=32, grad_accum=2, zero_grad="zeros")
    built = hf_builder(tmp_path, GPT2, recipe)
    (ran, _), (copied, _) = _ran_and_written(monkeypatch, built, recipe)
    assert written == [(True, ""), (False, "")]  # iteration 2 starts with gradients
    assert copied == ran


class Summed(nn.Module):
    """Two parameters handed one gradient tensor (``AddBackward``): the first
    ``AccumulateGrad`` cannot keep it, and copies it."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.empty(64, 64))
        self.q = nn.Parameter(torch.empty(64, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.p + self.q)


@pytest.mark.parametrize(
    ("module_type", "reason"),
    [
        (Summed, "a gradient was copied, not kept, by AccumulateGrad"),
        (Remembering, "made in the micro-step, outlives it"),
    ],
)
def test_a_micro_step_that_cannot_be_written_is_run(monkeypatch, written, module_type, reason):
    recipe = Recipe(batch_size=4, grad_accum=2, optimizer="sgd")
    (ran, _), (copied, _) = _ran_and_written(monkeypatch, lambda: meta_built(module_type), recipe)
    assert written and not any(copied for copied, _ in written) and reason in written[0][1]
    assert copied == ran
