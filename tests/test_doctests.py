"""Every ``>>>`` example in the package runs and prints what its docstring says.

An example that needs a GPU, a network or a long trace is written as a plain ``::`` code
block instead, so no example is marked ``+SKIP``.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import pkgutil
from pathlib import Path

import pytest

import vramplan

# ``python -m vramplan`` would run the command line on import.
NOT_IMPORTED = {"vramplan.__main__"}
# Modules whose examples build a model from an optional library (the test extra has them).
NEEDS = {
    "vramplan.sources": "torchvision",
    "vramplan.sources.base": "torchvision",
    "vramplan.sources.vision": "torchvision",
    "vramplan.sources.hf": "transformers",
    "vramplan.sources.hf_moe_linear": "transformers",
    "vramplan.distributed.facts": "transformers",
}


def _modules() -> list[str]:
    found = [vramplan.__name__]
    for info in pkgutil.walk_packages(vramplan.__path__, prefix="vramplan."):
        if info.name not in NOT_IMPORTED:
            found.append(info.name)
    return sorted(found)


MODULES = _modules()


def _with_examples(name: str) -> bool:
    spec = importlib.util.find_spec(name)
    return ">>>" in Path(spec.origin).read_text()


@pytest.mark.parametrize("name", [m for m in MODULES if _with_examples(m)])
def test_examples(name):
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = finder.find(module, module.__name__)
    assert tests, f"{name} has '>>>' but no example doctest finds"
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def test_no_example_is_skipped():
    # An example skipped everywhere is not a test: write it as a plain ``::`` block.
    skipped = [
        m
        for m in MODULES
        if "doctest: +SKIP" in Path(importlib.util.find_spec(m).origin).read_text()
    ]
    assert skipped == []


def test_every_module_imports():
    # Importing must need only the required dependencies (optional ones import lazily).
    for name in MODULES:
        importlib.import_module(name)
