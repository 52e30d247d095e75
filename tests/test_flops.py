"""The FLOPs plan needs are counted in the step's own trace: the events are those of the
plain trace, the total is PyTorch's FlopCounterMode's, and plan's bench runs no trace of
its own for them."""

from __future__ import annotations

import json

import pytest
from conftest import gqa_llama
from torch.utils.flop_counter import FlopCounterMode

from vramplan.device.options import device_options
from vramplan.pipeline import flop_counting_policy
from vramplan.planner.bench import Workbench
from vramplan.recipe import Recipe
from vramplan.sources import resolve
from vramplan.trace.events import FLOPS_KEY
from vramplan.trace.policy import CudaPolicy
from vramplan.trace.repeat import same_events
from vramplan.trace.step import trace_training

RECIPES = [
    Recipe(batch_size=2, seq_len=32, checkpointing="full"),
    Recipe(batch_size=2, seq_len=32, precision="amp-bf16", grad_accum=2),
]


class _ModuleCountingPolicy(CudaPolicy):
    """PyTorch's own FlopCounterMode, module tracking and all (the ground truth)."""

    def __init__(self) -> None:
        super().__init__()
        self.counter = FlopCounterMode(display=False)

    def dispatch_modes(self, recipe: Recipe) -> list:
        return [*super().dispatch_modes(recipe), self.counter]


@pytest.fixture
def llama(tmp_path) -> str:
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(gqa_llama(3)))
    return f"hf:{path}"


def _built(spec: str, recipe: Recipe):
    built = resolve(spec, recipe)
    built.repeat_blocks = False
    return built


@pytest.mark.parametrize("recipe", RECIPES, ids=["checkpointed", "amp-accumulated"])
def test_counting_leaves_the_events_and_counts_what_pytorch_counts(llama, recipe):
    plain = trace_training(_built(llama, recipe), recipe, CudaPolicy())
    policy = flop_counting_policy(device_options(gpu="a100-80gb"))
    counted = trace_training(_built(llama, recipe), recipe, policy)
    truth = _ModuleCountingPolicy()
    trace_training(_built(llama, recipe), recipe, truth)
    assert same_events(counted, plain)
    assert counted.op_counts == plain.op_counts and counted.notes == plain.notes
    assert policy.counter.get_total_flops() == truth.counter.get_total_flops() > 0


def test_plan_bench_reads_flops_off_the_steps_own_trace(llama):
    recipe = RECIPES[0]

    def bench(counts: bool) -> Workbench:
        made = Workbench(llama, device_options(gpu="a100-80gb"), build=_built)
        made.counts_flops = counts
        return made

    shared = bench(True)
    estimate = shared.estimate(recipe)
    flops = shared.flops(recipe)
    assert shared.traces == 1
    separate = bench(False)
    assert separate.estimate(recipe) == estimate
    assert separate.flops(recipe) == flops == shared.run(recipe)[1].op_counts[FLOPS_KEY]
    assert separate.traces == 2


@pytest.mark.parametrize("stack", ["torch2.11-cu13.0", "torch1.10-cu11.3"])
def test_the_counting_policy_traces_under_the_estimates_rules(stack):
    """The planner traces its steps with the counting policy; it keeps every rule of the
    estimate's (the stack's saving rules, the card its kernels' scratch is sized for), so
    a plan's figures are the estimate's."""
    from vramplan.pipeline import cuda_policy

    device = device_options(gpu="l4", stack=stack)
    counting, plain = vars(flop_counting_policy(device)), vars(cuda_policy(device))
    assert counting.pop("counter") is not None
    assert counting["scratch"].card == plain["scratch"].card
    assert {k: v for k, v in counting.items() if k != "scratch"} == {
        k: v for k, v in plain.items() if k != "scratch"
    }
