"""The keyed fake mode: its cache key tells tensors apart exactly where PyTorch's does, its
shortcuts answer as PyTorch does, and a traced step is the same under it as under
PyTorch's own ``FakeTensorMode``."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode, extract_tensor_metadata

from vramplan.device.options import device_options
from vramplan.pipeline import trace_and_estimate
from vramplan.recipe import Recipe
from vramplan.sources import resolve
from vramplan.trace import step
from vramplan.trace.fake_mode import KeyedFakeTensorMode, fake_mode, tensor_key
from vramplan.trace.repeat import same_events


def _tensors() -> list[torch.Tensor]:
    """Fake tensors that differ in one field of PyTorch's metadata at a time (and some
    that differ in none)."""
    base = torch.empty(4, 6, device="cuda")
    grad = torch.empty(4, 6, device="cuda", requires_grad=True)
    complex_ = torch.empty(4, 6, dtype=torch.complex64, device="cuda")
    with torch.inference_mode():
        inference = torch.empty(4, 6, device="cuda")
    return [
        base,
        torch.empty(4, 6, device="cuda"),  # the same metadata as ``base``
        torch.empty(4, 6, dtype=torch.bfloat16, device="cuda"),
        torch.empty(6, 4, device="cuda"),
        base.t(),  # strides
        torch.empty(24, device="cuda")[:24].view(4, 6),  # as ``base``
        torch.empty(25, device="cuda")[1:].view(4, 6),  # storage offset
        torch.empty(30, device="cuda")[:24].view(4, 6),  # storage bytes
        grad,
        grad.detach(),  # as ``base``
        complex_,
        complex_.conj(),
        torch._neg_view(complex_),
        inference,
        torch.empty(2, 3, 4, 4, device="cuda"),
        torch.empty(2, 3, 4, 4, device="cuda").to(memory_format=torch.channels_last),
        torch.empty(4, 6),  # another device
        torch.empty(4, 6, device="cuda:1"),
    ]


def test_tensor_keys_are_equal_exactly_where_pytorchs_metadata_is():
    with KeyedFakeTensorMode():
        tensors = _tensors()
        keys = [tensor_key(t) for t in tensors]
        metadata = [extract_tensor_metadata(t) for t in tensors]
    for i, j in itertools.combinations(range(len(tensors)), 2):
        assert (keys[i] == keys[j]) == (metadata[i] == metadata[j]), (i, j)
    alike = [i for i, key in enumerate(keys) if key == keys[0]]
    assert alike == [0, 1, 5, 9]
    assert len(set(keys)) == len(keys) - 3


def test_unsafe_view_is_answered_from_the_cache_on_its_input_storage():
    with KeyedFakeTensorMode():
        x = torch.empty(4, 6, device="cuda")
        first = torch.ops.aten._unsafe_view(x, [24])
        hits = FakeTensorMode.cache_info().hits
        second = torch.ops.aten._unsafe_view(x, [24])
        assert FakeTensorMode.cache_info().hits == hits + 1
    for out in (first, second):
        assert out.untyped_storage()._cdata == x.untyped_storage()._cdata
        assert (out.shape, out.stride(), out.storage_offset()) == ((24,), (1,), 0)


def test_unsafe_view_of_what_cannot_be_viewed_fails_as_in_pytorchs_mode():
    errors = []
    for mode in (FakeTensorMode, KeyedFakeTensorMode):
        with mode(), pytest.raises((RuntimeError, ValueError)) as raised:
            torch.ops.aten._unsafe_view(torch.empty(4, 6, device="cuda").t(), [24])
        errors.append((type(raised.value), str(raised.value)))
    assert errors[0] == errors[1]


@pytest.mark.parametrize("value", [3.5, 7, True, math.pi])
def test_item_of_a_constant_is_the_constant(value):
    answers = []
    for mode in (FakeTensorMode, KeyedFakeTensorMode):
        with mode():
            answers.append(torch.tensor(value).item())
    real = torch.tensor(value).item()  # a real CPU tensor: float32 for a float
    assert answers[0] == answers[1] == real
    assert type(answers[0]) is type(answers[1]) is type(real)


def test_the_installed_torch_gets_the_keyed_mode():
    # the signature the override relies on (PyTorch 2.4 and later)
    assert isinstance(fake_mode(), KeyedFakeTensorMode)


@pytest.mark.parametrize(
    "knobs",
    [
        {},
        {"precision": "amp-bf16", "checkpointing": "full"},
        {"optimizer": "adam", "grad_accum": 2},
        {"mode": "infer"},
        # foreach steps (trace/fake_foreach.py) of the other torch.optim optimizers
        {"optimizer": "momentum"},
        {"optimizer": "adagrad"},
        {"optimizer": "rmsprop", "precision": "amp-fp16"},
        {"optimizer": "adamw", "precision": "bf16"},
    ],
)
def test_a_traced_step_is_the_same_under_pytorchs_own_mode(tmp_path, monkeypatch, knobs):
    pytest.importorskip("transformers")
    from conftest import PLAN_LLAMA

    path = tmp_path / "llama.json"
    path.write_text(json.dumps(PLAN_LLAMA))
    recipe = Recipe(batch_size=2, seq_len=32, **knobs)
    device = device_options(gpu="a100-80gb")
    results = []
    for mode in (FakeTensorMode, fake_mode):
        monkeypatch.setattr(step, "fake_mode", mode)
        built = resolve(f"hf:{path}", recipe)
        built.repeat_blocks = False
        results.append(trace_and_estimate(built, recipe, "cuda", device))
    (plain, plain_trace), (keyed, keyed_trace) = results
    assert keyed.to_json() == plain.to_json()
    assert same_events(keyed_trace, plain_trace)
    assert keyed_trace.op_counts == plain_trace.op_counts
