"""Pointwise foreach ops answered without their meta kernels: the same answers as PyTorch's
``FakeTensorMode`` (tensors of the same shape, strides, dtype, device and storage size;
the same errors), the shortcut taken exactly where it applies. Traced steps with each
torch.optim optimizer against PyTorch's mode: ``test_fake_mode.py``."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from vramplan.trace.fake_foreach import pointwise_foreach
from vramplan.trace.fake_mode import KeyedFakeTensorMode

SHAPES = [(8, 4), (16,), (), (3, 5, 2)]


def _lists(count: int, dtype=torch.float32) -> list[list[torch.Tensor]]:
    return [[torch.empty(s, dtype=dtype, device="cuda") for s in SHAPES] for _ in range(count)]


@pytest.fixture
def taken(monkeypatch) -> list[bool]:
    """Whether the shortcut answered, for each foreach op the keyed mode was asked."""
    answered = []

    def spy(mode, dense, func, args, kwargs):
        answer = pointwise_foreach(mode, dense, func, args, kwargs)
        answered.append(answer is not NotImplemented)
        return answer

    monkeypatch.setattr("vramplan.trace.fake_mode.pointwise_foreach", spy)
    return answered


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
def test_the_shortcut_answers_as_pytorchs_mode(name, taken):
    lists, call = CALLS[name]
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
def test_what_the_shortcut_does_not_take_goes_to_pytorch(name, taken):
    lists, call, dtype = _not_plain()[name]
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
