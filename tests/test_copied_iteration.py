"""The second iteration's passes copied from the first: the trace equals a traced second
iteration, allocation for allocation, and a run that carries storage into the next
iteration is traced in full."""

from __future__ import annotations

import pytest
import torch
from conftest import PLAN_LLAMA as LLAMA
from conftest import TINY_GPT2 as GPT2
from conftest import Remembering, hf_builder, meta_built
from torch import nn

from vramplan.recipe import Recipe
from vramplan.sources import resolve
from vramplan.sources.base import BuiltModel
from vramplan.trace import copied_iteration
from vramplan.trace.flops import FlopCountingPolicy
from vramplan.trace.policy import CpuPolicy, CudaPolicy
from vramplan.trace.step import trace_training


@pytest.fixture
def copies(monkeypatch) -> list[bool]:
    """Whether each traced run's second iteration was copied (``IterationCopy.skips``)."""
    answers: list[bool] = []
    skips = copied_iteration.IterationCopy.skips

    def watched(self, iteration: int) -> bool:
        copied = skips(self, iteration)
        if iteration == 2:
            answers.append(copied)
        return copied

    monkeypatch.setattr(copied_iteration.IterationCopy, "skips", watched)
    return answers


def _traced_and_copied(make_built, recipe: Recipe, policy_type=CudaPolicy):
    """(trace, policy) with the second iteration traced, then with it copied."""
    results = []
    for copy in (False, True):
        built = make_built()
        built.copy_iteration = copy
        policy = policy_type()
        results.append((trace_training(built, recipe, policy), policy))
    return results


@pytest.mark.parametrize(
    ("config", "knobs"),
    [
        (GPT2, {}),
        (LLAMA, {"precision": "amp-bf16", "optimizer": "sgd", "grad_accum": 4}),
        (LLAMA, {"checkpointing": "full", "activation_offload": True}),
        (LLAMA, {"precision": "bf16", "optimizer": "adam8bit"}),
        (LLAMA, {"optimizer": "adafactor", "lora_rank": 4}),
        (LLAMA, {"mode": "infer"}),
        # the step in backward: the second steps put where the first ones stood
        (LLAMA, {"optimizer_in_backward": True}),
        (LLAMA, {"optimizer_in_backward": True, "optimizer": "momentum"}),
        (LLAMA, {"optimizer_in_backward": True, "optimizer": "adam8bit", "checkpointing": "full"}),
        (LLAMA, {"optimizer_in_backward": True, "activation_offload": True, "lora_rank": 4}),
    ],
)
def test_copied_passes_equal_traced_ones(tmp_path, copies, config, knobs):
    recipe = Recipe(batch_size=2, seq_len=32, **knobs)
    (traced, _), (copied, _) = _traced_and_copied(hf_builder(tmp_path, config, recipe), recipe)
    assert copies == [True]  # (the traced run offers no copy)
    assert copied == traced  # every allocation, phase mark, op count, note and marker
    assert {a.iteration for a in copied.allocations} >= {1, 2}


def test_copied_passes_keep_flops_and_convolution_markers(copies):
    recipe = Recipe(batch_size=2, input_shape=(3, 64, 64), optimizer="sgd")
    resnet = lambda: resolve("torchvision:resnet18", recipe)  # noqa: E731
    (traced, counted), (copied, recounted) = _traced_and_copied(resnet, recipe, FlopCountingPolicy)
    assert copies == [True]  # (the traced run offers no copy)
    assert copied == traced
    assert len(copied.markers) > 40  # the second iteration's convolutions are there
    assert recounted.counter.get_total_flops() == counted.counter.get_total_flops() > 0


def test_cpu_kernel_notes_count_the_copied_passes(copies):
    recipe = Recipe(batch_size=2, input_shape=(3, 32, 32), optimizer="sgd")
    resnet = lambda: resolve("torchvision:resnet18", recipe)  # noqa: E731
    (traced, _), (copied, policy) = _traced_and_copied(resnet, recipe, CpuPolicy)
    assert copies == [True]  # (the traced run offers no copy)
    assert copied == traced and policy.trace_notes() == list(traced.notes)


def _remembering() -> BuiltModel:
    return meta_built(Remembering)


def test_storage_kept_into_the_next_iteration_is_traced(copies):
    recipe = Recipe(batch_size=4, optimizer="adamw")
    (traced, _), (copied, _) = _traced_and_copied(_remembering, recipe)
    assert copies == [False]
    assert copied == traced
    # the kept output of iteration 1 dies in iteration 2's forward pass
    kept = [a for a in traced.allocations if a.iteration == 1 and a.module == "fc"]
    forward_2 = next(m.index for m in traced.phases if (m.phase, m.iteration) == ("forward", 2))
    assert any(a.free_index is not None and a.free_index > forward_2 for a in kept)


def test_gradients_kept_by_zero_grad_are_traced(copies):
    recipe = Recipe(batch_size=4, optimizer="adamw", zero_grad="zeros")
    (traced, _), (copied, _) = _traced_and_copied(_remembering, recipe)
    assert copies == []  # never offered: zero_grad keeps the gradients by design
    assert copied == traced


class Replacing(torch.optim.Optimizer):
    """Keeps a copy of the last gradient as its state, made anew at every step: the second
    step frees the first one's state."""

    def __init__(self, params) -> None:
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                self.state[param]["last"] = param.grad.clone()


def test_state_replaced_by_the_second_step(copies):
    recipe = Recipe(batch_size=4, optimizer="adamw")

    def built() -> BuiltModel:
        model = _remembering()
        model.model = nn.Sequential(nn.Linear(64, 64, device="meta"))
        model.make_optimizer = lambda params, _recipe: Replacing(params)
        return model

    (traced, _), (copied, _) = _traced_and_copied(built, recipe)
    assert copies == [True]
    assert copied == traced
    state = [a for a in traced.allocations if a.category == "optimizer_state"]
    assert any(a.iteration == 1 and a.free_index is not None for a in state)
