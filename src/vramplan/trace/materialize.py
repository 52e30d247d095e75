"""Turn a meta-device model into fake CPU tensors, keeping tied weights tied.

>>> from torch._subclasses.fake_tensor import FakeTensorMode
>>> model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)).to("meta")
>>> model[1].weight = model[0].weight
>>> with FakeTensorMode():
...     materialize(model)
>>> model[0].weight.device, model[1].weight is model[0].weight
(device(type='cpu'), True)
"""

from __future__ import annotations

import torch
from torch import nn


def _empty_like(tensor: torch.Tensor, device: str) -> torch.Tensor:
    return torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device=device)


def materialize(model: nn.Module, device: str = "cpu") -> None:
    """Replace every meta parameter and buffer with an uninitialised tensor on ``device``
    (fake when a FakeTensorMode is active). A parameter shared by two modules stays one."""
    replaced: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in replaced:
                replaced[id(param)] = nn.Parameter(
                    _empty_like(param, device), requires_grad=param.requires_grad
                )
            module._parameters[name] = replaced[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is None:
                continue
            if id(buffer) not in replaced:
                replaced[id(buffer)] = _empty_like(buffer, device)
            module._buffers[name] = replaced[id(buffer)]


def unique_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters of ``model`` without duplicates (tied weights counted once)."""
    seen: set[int] = set()
    unique = []
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            unique.append(param)
    return unique
