"""Which module is running: a stack kept by global forward hooks.

>>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
>>> stack = ModuleStack()
>>> stack.name_modules(model)
>>> seen = []
>>> _ = model[1].register_forward_pre_hook(lambda *_: seen.append(stack.innermost()))
>>> with stack:
...     _ = model(torch.zeros(1, 4))
>>> seen, stack.kinds["1"]
(['1'], 'ReLU')
"""

from __future__ import annotations

import torch
from torch import nn


class ModuleStack:
    """Tracks the innermost module in forward, by qualified name (``layer1.0.conv1``)."""

    def __init__(self) -> None:
        self.names: dict[int, str] = {}
        self.kinds: dict[str, str] = {}
        self._stack: list[str] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def name_modules(self, model: nn.Module) -> None:
        """Learn the qualified names of ``model``'s submodules."""
        for name, module in model.named_modules():
            self.names[id(module)] = name or "(model)"
            self.kinds[name or "(model)"] = _class_name(module)

    def innermost(self) -> str:
        return self._stack[-1] if self._stack else ""

    def _pre(self, module: nn.Module, args) -> None:
        name = self.names.get(id(module))
        if name is not None:
            self._stack.append(name)

    def _post(self, module: nn.Module, args, output) -> None:
        name = self.names.get(id(module))
        if name is not None and self._stack and self._stack[-1] == name:
            self._stack.pop()

    def reset(self) -> None:
        self._stack.clear()

    def __enter__(self) -> ModuleStack:
        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(self._pre),
            nn.modules.module.register_module_forward_hook(self._post, always_call=True),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack.clear()


def _class_name(module: nn.Module) -> str:
    """The module's own class name; FSDP2 swaps in a subclass named ``FSDP<name>``."""
    cls = type(module)
    if cls.__name__.startswith("FSDP") and len(cls.__bases__) == 2:
        return cls.__bases__[1].__name__
    return cls.__name__
