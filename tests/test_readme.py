"""The README's Python examples run as written, with small stand-ins for the models they
name (a tiny GPT-2 config for ``hf:gpt2``, a small CNN file for ``torchvision:resnet18``,
a small classifier for ``my_model``) so the test stays quick."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_python_examples():
    blocks = python_blocks()
    assert len(blocks) >= 2
    assert any("example_batch=(images, labels)" in block for block in blocks)


def test_the_readme_python_examples_run(gpt2_config, tmp_path):
    config = gpt2_config(n_positions=1024)
    factory = tmp_path / "net.py"
    factory.write_text(
        "from torch import nn\n"
        "def make():\n"
        "    return nn.Sequential(nn.Conv2d(3, 4, 3, stride=4), nn.ReLU(),\n"
        "                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))\n"
    )
    namespace = {
        "my_model": nn.Sequential(
            nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10)
        ),
        "images": torch.randn(4, 3, 32, 32),
        "labels": torch.randint(0, 10, (4,)),
    }
    for block in python_blocks():
        code = block.replace('"hf:gpt2"', repr(f"hf:{config}")).replace(
            '"torchvision:resnet18"', repr(f"{factory}:make")
        )
        exec(compile(code, str(README), "exec"), namespace)  # noqa: S102
    est = namespace["est"]  # the last example: the user's own step on an L4
    assert est.recipe.batch_size == 4 and est.verdict.gpu == "L4"
