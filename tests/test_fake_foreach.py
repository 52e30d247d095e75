"""Pointwise foreach ops answered without their meta kernels: the same answers as PyTorch's
``FakeTensorMode`` (tensors of the same shape, strides, dtype, device and storage size;
the same errors), the shortcut taken exactly where it applies, and every torch.optim
optimizer's traced step the same under it as under PyTorch's mode."""

from __future__ import annotations

import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from vramplan.device.options import device_options
from vramplan.pipeline import trace_and_estimate
from vramplan.recipe import Recipe
from vramplan.sources import resolve
from vramplan.trace import step
from vramplan.trace.fake_foreach import pointwise_foreach
from vramplan.trace.fake_mode import KeyedFakeTensorMode, fake_mode
from vramplan.trace.repeat import same_events

SHAPES = [(8, 4), (16,), (), (3, 5, 2)]


def _lists(count: int, dtype=torch.float32) -> list[list[torch.Tensor]]:
    return [[torch.empty(s, dtype=dtype, device="cuda") for s in SHAPES] for _ in range(count)]


CALLS = {  # name: (how many lists, the call)
    "sqrt": (1, lambda a: torch._foreach_sqrt(a)),
    "add list": (2, lambda a, b: torch._foreach_add(a, b, alpha=0.5)),
    "mul scalar": (1, lambda a: torch._foreach_mul(a, 0.9)),
    "div scalar list": (1, lambda a: torch._foreach_div(a, [2.0, 3.0, 4.0, 5.0])),
    "lerp": (2, lambda a, b: torch._foreach_lerp(a, b, 0.1)),
    "addcdiv": (3, lambda a, b, c: torch._foreach_addcdiv(a, b, c, [0.1, 0.2, 0.3, 0.4])),
    "mul_": (1, lambda a: torch._foreach_mul_(a, 0.9)),
    "lerp_": (2, lambda a, b: torch._foreach_lerp_(a, b, 0.1)),
    "addcmul_": (3, lambda a, b, c: torch._foreach_addcmul_(a, b, c, value=0.001)),
    "addcdiv_": (3, lambda a, b, c: torch._foreach_addcdiv_(a, b, c, [0.1, 0.2, 0.3, 0.4])),
    "add_ list": (2, lambda a, b: torch._foreach_add_(a, b)),
    "zero_": (1, lambda a: torch._foreach_zero_(a)),
    "copy_": (2, lambda a, b: torch._foreach_copy_(a, b)),
}


def _described(answer) -> object:
    if answer is None:
        return None
    return [
        (t.shape, t.stride(), t.dtype, t.device, t.untyped_storage().nbytes(), t.requires_grad)
        for t in answer
    ]


def _answers(call, lists: int, dtype=torch.float32) -> list[object]:
    answers = []
    for mode in (FakeTensorMode, KeyedFakeTensorMode):
        with mode():
            answers.append(_described(call(*_lists(lists, dtype))))
    return answers


@pytest.mark.parametrize("name", list(CALLS))
def test_the_shortcut_answers_as_pytorchs_mode(name, monkeypatch):
    lists, call = CALLS[name]
    taken = []

    def spy(mode, func, args, kwargs):
        answer = pointwise_foreach(mode, func, args, kwargs)
        taken.append(answer is not NotImplemented)
        return answer

    monkeypatch.setattr("vramplan.trace.fake_mode.pointwise_foreach", spy)
    plain, keyed = _answers(call, lists)
    assert keyed == plain
    assert taken == [True]


def test_an_out_of_place_answer_is_new_storage_of_the_first_lists_shapes():
    with KeyedFakeTensorMode():
        (first,) = _lists(1, torch.bfloat16)
        out = torch._foreach_sqrt(first)
    for made, source in zip(out, first, strict=True):
        assert made.untyped_storage()._cdata != source.untyped_storage()._cdata
        assert (made.shape, made.dtype, made.device) == (source.shape, source.dtype, source.device)
        assert made.is_contiguous()


def _not_plain():
    """Calls the shortcut leaves to PyTorch: (lists, call, dtype)."""
    transposed = lambda a: torch._foreach_sqrt([t.t() if t.dim() == 2 else t for t in a])  # noqa: E731
    return {
        "integer lists": (1, lambda a: torch._foreach_mul(a, 2), torch.int64),
        "a tensor operand": (
            1,
            lambda a: torch._foreach_mul_(a, torch.empty((), device="cuda")),
            None,
        ),
        "a reduction": (1, lambda a: torch._foreach_norm(a), None),
        "strided views": (1, transposed, None),
        "a complex scalar": (1, lambda a: torch._foreach_mul(a, 1j), None),
    }


@pytest.mark.parametrize("name", list(_not_plain()))
def test_what_the_shortcut_does_not_take_goes_to_pytorch(name, monkeypatch):
    lists, call, dtype = _not_plain()[name]
    taken = []

    def spy(mode, func, args, kwargs):
        answer = pointwise_foreach(mode, func, args, kwargs)
        taken.append(answer is not NotImplemented)
        return answer

    monkeypatch.setattr("vramplan.trace.fake_mode.pointwise_foreach", spy)
    plain, keyed = _answers(call, lists, dtype or torch.float32)
    assert keyed == plain
    assert not any(taken)


@pytest.mark.parametrize(
    "call",
    [
        lambda a, b: torch._foreach_add_(a, b[:-1]),  # lists of different lengths
        lambda a, b: torch._foreach_add_(a, b[::-1]),  # shapes that do not broadcast
    ],
)
def test_mismatched_lists_fail_as_in_pytorchs_mode(call):
    errors = []
    for mode in (FakeTensorMode, KeyedFakeTensorMode):
        with mode(), pytest.raises(RuntimeError) as raised:
            call(*_lists(2))
        errors.append(str(raised.value))
    assert errors[0] == errors[1]


def test_mixed_dtypes_at_an_index_go_to_pytorch():
    answers = []
    for mode in (FakeTensorMode, KeyedFakeTensorMode):
        with mode():
            (a,) = _lists(1, torch.bfloat16)
            (b,) = _lists(1, torch.float32)
            answers.append(_described(torch._foreach_add(a, b)))
    assert answers[0] == answers[1]
    assert answers[0][0][2] == torch.float32  # promoted: not the first list's dtype


@pytest.mark.parametrize(
    "knobs",
    [
        {"optimizer": "momentum"},
        {"optimizer": "adagrad"},
        {"optimizer": "rmsprop", "precision": "amp-fp16"},
        {"optimizer": "adamw", "precision": "bf16"},
    ],
)
def test_each_optimizers_traced_step_is_the_same_under_pytorchs_mode(tmp_path, monkeypatch, knobs):
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
