"""Replace functions for the length of a block, everywhere they are looked up.

A ``TorchFunctionMode`` would be the natural hook, but autograd's engine does not run a
checkpointed block's recomputation under it (the mode is off while ``backward`` itself is
dispatched), so a rule applied only in the first forward makes the recomputation save a
different number of tensors. Attributes replaced on their modules and on ``torch.Tensor``
stay in place through backward::

    with patched([(torch, "softmax", my_softmax)]):
        ...   # torch.softmax is my_softmax here, and back to PyTorch's after
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

_MISSING = object()


@contextlib.contextmanager
def patched(replacements: Iterable[tuple[object, str, Callable]]) -> Iterator[None]:
    """Set ``owner.name = function`` for each triple during the block; afterwards restore
    what the owner itself held (or remove the attribute, when it was inherited)."""
    saved = []
    try:
        for owner, name, function in replacements:
            saved.append((owner, name, vars(owner).get(name, _MISSING)))
            setattr(owner, name, function)
        yield
    finally:
        for owner, name, previous in reversed(saved):
            if previous is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)
