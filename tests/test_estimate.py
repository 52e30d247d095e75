"""Exact arithmetic of the traced components: parameters, gradients, optimizer state,
and how activations scale with the batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vramplan
from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe
from vramplan.sources.user_code import module_source
from vramplan.trace.policy import CudaPolicy
from vramplan.trace.step import trace_training


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


def _built(recipe: Recipe, factory=mlp, shape=(256,)):
    with torch.device("meta"):
        model = factory()
    return module_source(model, recipe.with_changes(input_shape=shape), factory.__name__)


def _param_bytes(factory=mlp) -> int:
    model = factory()
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _final_bytes(recipe: Recipe, category: str) -> int:
    """Bytes of ``category`` still alive when the traced run ends."""
    trace = trace_training(_built(recipe), recipe, CudaPolicy())
    return sum(
        a.nbytes for a in trace.allocations if a.category == category and a.free_index is None
    )


def _peak_of(recipe: Recipe, category: str) -> int:
    """Most bytes of ``category`` alive at once during the run."""
    trace = trace_training(_built(recipe), recipe, CudaPolicy())
    live = peak = 0
    for event in trace.events():
        if event.allocation.category == category:
            live += event.delta
            peak = max(peak, live)
    return peak


def test_parameter_bytes_are_numel_times_element_size():
    est = estimate_built(_built(Recipe(batch_size=4)), Recipe(batch_size=4), target="cpu")
    expected = _param_bytes()
    assert est.model.parameter_bytes == expected
    assert est.components["parameters"] == expected
    assert est.model.parameters == sum(p.numel() for p in mlp().parameters())


@pytest.mark.parametrize(
    "optimizer,factor",
    [
        ("sgd", 0),
        ("momentum", 1),
        ("adam", 2),
        ("adamw", 2),
        ("adagrad", 1),
        ("rmsprop", 1),
        ("lion", 1),
    ],
)
def test_optimizer_state_per_parameter(optimizer, factor):
    recipe = Recipe(batch_size=4, optimizer=optimizer)
    assert _final_bytes(recipe, "optimizer_state") == factor * _param_bytes()


def test_adam8bit_state_layout():
    recipe = Recipe(batch_size=4, optimizer="adam8bit")
    expected = 0
    for p in mlp().parameters():
        if p.numel() >= 4096:
            expected += 2 * p.numel() + 2 * 4 * -(-p.numel() // 256)
        else:
            expected += 8 * p.numel()
    expected += 2 * 256 * 4  # the two shared quantization maps (qmap1, qmap2), fp32
    assert _final_bytes(recipe, "optimizer_state") == expected


def test_gradients_peak_at_parameter_bytes():
    assert _peak_of(Recipe(batch_size=4, optimizer="sgd"), "gradients") == _param_bytes()


def test_zero_grad_frees_gradients_between_steps():
    assert _final_bytes(Recipe(batch_size=4, optimizer="adamw"), "gradients") == 0


def test_doubling_batch_doubles_activations_only():
    small = estimate_built(_built(Recipe(batch_size=16)), Recipe(batch_size=16))
    large = estimate_built(_built(Recipe(batch_size=32)), Recipe(batch_size=32))
    assert large.components["parameters"] == small.components["parameters"]
    assert _final_bytes(Recipe(batch_size=16), "optimizer_state") == _final_bytes(
        Recipe(batch_size=32), "optimizer_state"
    )
    ratio = _peak_of(Recipe(batch_size=32), "activations") / _peak_of(
        Recipe(batch_size=16), "activations"
    )
    assert ratio == pytest.approx(2.0, rel=0.02)


def test_pure_half_precision_halves_parameter_bytes():
    est = estimate_built(
        _built(Recipe(batch_size=4, precision="bf16")), Recipe(batch_size=4, precision="bf16")
    )
    assert est.model.parameter_bytes == _param_bytes() // 2


def test_inference_keeps_no_gradients_or_state():
    recipe = Recipe(batch_size=64, mode="infer")
    est = estimate_built(_built(recipe), recipe)
    assert est.recipe.optimizer == "none"
    assert est.components["gradients"] == 0
    assert est.components["optimizer_state"] == 0
    assert _peak_of(recipe, "gradients") == 0


def test_gradient_accumulation_keeps_micro_batch_activations():
    accum = Recipe(batch_size=8, grad_accum=4)
    single = Recipe(batch_size=8)
    big = Recipe(batch_size=32)
    assert _peak_of(accum, "activations") == _peak_of(single, "activations")
    assert _peak_of(big, "activations") > 3 * _peak_of(accum, "activations")


def test_checkpointing_reduces_activations_of_repeated_blocks():
    from torchvision.models.vision_transformer import VisionTransformer

    def vit():
        return VisionTransformer(
            image_size=32,
            patch_size=4,
            num_layers=4,
            num_heads=2,
            hidden_dim=64,
            mlp_dim=128,
            num_classes=10,
        )

    plain = Recipe(batch_size=8)
    full = Recipe(batch_size=8, checkpointing="full")
    plain_est = estimate_built(_built(plain, vit, (3, 32, 32)), plain)
    full_est = estimate_built(_built(full, vit, (3, 32, 32)), full)
    assert full_est.peak.allocated_bytes < plain_est.peak.allocated_bytes
    assert full_est.model.parameter_bytes == plain_est.model.parameter_bytes


def test_components_sum_to_peak_and_phase_is_known():
    est = vramplan.estimate(mlp(), input_shape=(256,), batch_size=8, target="cpu")
    assert sum(est.components.values()) == est.peak.allocated_bytes
    assert est.peak.phase in ("forward", "backward", "optimizer")
    assert max(est.phase_peaks.values()) == est.peak.allocated_bytes


def test_user_module_is_not_modified():
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    vramplan.estimate(model, input_shape=(256,), batch_size=8)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert next(model.parameters()).device.type == "cpu"


def test_estimate_step_traces_the_users_own_loop():
    model = mlp()

    def step(net, batch, optimizer):
        x, y = batch
        loss = nn.functional.cross_entropy(net(x), y) + 0.01 * net[0].weight.pow(2).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    batch = (torch.randn(16, 256), torch.randint(0, 10, (16,)))
    est = vramplan.estimate_step(
        step, model, batch, lambda p: torch.optim.AdamW(p, foreach=True), target="cpu"
    )
    assert est.recipe.batch_size == 16
    param_bytes = _param_bytes()
    assert est.components["parameters"] == param_bytes
    assert est.phase_peaks["optimizer"] >= param_bytes * 4  # params + grads + 2 Adam moments
    assert set(est.phase_peaks) >= {"forward", "backward", "optimizer"}
