"""Import a library without the optional backends it probes for but a traced step never runs.

diffusers' ``ModelMixin`` module imports its quantizers and hooks eagerly: bitsandbytes
(which pulls in ``torch._inductor``), peft (which pulls in transformers' modeling code),
transformers' quantization configs, accelerate, and through them scipy: 3-4 of the 6 CPU
seconds ``diffusers.UNet2DConditionModel`` costs on a 2-core machine, for loading
quantized or LoRA weights, which a model built on the meta device from its config never
does. diffusers asks ``importlib.util.find_spec`` whether each is installed, and
``find_spec`` answers None for a name whose ``sys.modules`` entry is None; the entries are
removed again afterwards, so the packages import normally later (vramplan's own
``transformers`` import for the frozen text encoder included). diffusers itself keeps
its answer for the process: ``is_peft_available()`` is False after this import.

>>> import sys
>>> with hidden(("a_package_nobody_installed",)):
...     "a_package_nobody_installed" in sys.modules
True
>>> "a_package_nobody_installed" in sys.modules
False
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

DIFFUSERS_UNUSED = ("bitsandbytes", "peft", "transformers", "accelerate", "scipy")
"""What diffusers probes for at import that a config-built UNet or DiT does not use."""


@contextlib.contextmanager
def hidden(packages: tuple[str, ...]) -> Iterator[None]:
    """``packages`` not yet imported look uninstalled inside the block."""
    absent = [name for name in packages if name not in sys.modules]
    for name in absent:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        for name in absent:
            if sys.modules.get(name, False) is None:
                del sys.modules[name]
