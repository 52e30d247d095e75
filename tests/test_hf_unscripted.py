"""A modeling module imported while a hf: model is built keeps its ``@torch.jit.script``
helpers as Python, which fake tensors run (TorchScript's interpreter does not), as
transformers 5.17's DeBERTa-v2 needs."""

from __future__ import annotations

import importlib
import sys

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from vramplan.sources.hf import unscripted

HELPER = """
import torch

@torch.jit.script
def log_bucket(relative_pos: torch.Tensor, bucket_size: int) -> torch.Tensor:
    sign = torch.sign(relative_pos)
    return sign * torch.log(torch.abs(relative_pos).float() + 1) * bucket_size
"""


def _import_fresh(tmp_path, name: str):
    (tmp_path / f"{name}.py").write_text(HELPER)
    sys.path.insert(0, str(tmp_path))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(tmp_path))


def test_scripted_helpers_stay_python_and_run_on_fake_tensors(tmp_path):
    scripted = _import_fresh(tmp_path, "scripted_helper")
    with unscripted():
        plain = _import_fresh(tmp_path, "plain_helper")
    assert isinstance(scripted.log_bucket, torch.jit.ScriptFunction)
    assert not isinstance(plain.log_bucket, torch.jit.ScriptFunction)
    x = torch.arange(-3, 4)
    assert torch.equal(plain.log_bucket(x, 4), scripted.log_bucket(x, 4))
    with FakeTensorMode():
        assert plain.log_bucket(torch.empty(2, 8), 4).shape == (2, 8)
    assert torch.jit.script is not None and torch.jit.script.__name__ == "script"
