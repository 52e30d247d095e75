"""The shape of the house: imports flow one way, from the stages below to the front door
and the renderers above, and the command line speaks only to the public API.

The graph is read from the source with ``ast`` (imports inside functions included), so a
late import cannot hide a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import vramplan

PACKAGE = Path(vramplan.__file__).parent
LOWER = ("vramplan.trace", "vramplan.sources", "vramplan.device", "vramplan.result")
UPPER = (
    "vramplan.planner",
    "vramplan.cli",
    "vramplan.report",
    "vramplan.session",
    "vramplan.api",
    "vramplan.quick",
    "vramplan.integrations",
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """vramplan modules ``path`` imports anywhere in its body (``from x import y`` counts
    as ``x.y`` when that is a module, else ``x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("vramplan"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if not node.module.startswith("vramplan"):
                continue
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in modules else node.module)
    return {name for name in found if name in modules}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_graph_is_read():
    graph = _graph()
    assert "vramplan.device.replay" in graph["vramplan.pipeline"]
    assert "vramplan.session" in graph["vramplan.api"]


def test_no_import_cycle():
    graph = _graph()
    # the package root re-exports the public API; edges *into* it are the only ones that
    # would close a cycle through it, and they are forbidden below
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for child in sorted(graph[node]):
            if state.get(child) == 1:
                cycle = path[path.index(child) :] + [child]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if child not in state:
                visit(child)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_nothing_imports_the_package_root():
    graph = _graph()
    importers = sorted(
        name
        for name, children in graph.items()
        if "vramplan" in children and not name.startswith("vramplan.cli")
    )
    assert importers == []


def test_lower_stages_never_import_upper_ones():
    graph = _graph()
    bad = sorted(
        f"{name} imports {child}"
        for name, children in graph.items()
        if _under(name, LOWER)
        for child in children
        if _under(child, UPPER) or child == "vramplan"
    )
    assert bad == []


STAGE_ORDER = (
    # each stage may import those on its own line and the lines above it, never below
    ("vramplan.errors", "vramplan.units", "vramplan.version", "vramplan.recipe", "vramplan.ops"),
    ("vramplan.result", "vramplan.optimizers", "vramplan.sources", "vramplan.trace"),
    ("vramplan.device",),
    ("vramplan.pipeline", "vramplan.analytic"),
    ("vramplan.distributed", "vramplan.measurement"),
    # training configs (DeepSpeed, accelerate, torchtune, ...) read into a Recipe and a
    # ParallelLayout: above distributed, whose layouts they build; nothing below reads them
    ("vramplan.configs",),
    ("vramplan.planner",),
)


def _level(name: str) -> int | None:
    for level, stages in enumerate(STAGE_ORDER):
        if _under(name, stages):
            return level
    return None


def test_each_stage_imports_only_its_own_level_and_below():
    graph = _graph()
    bad = sorted(
        f"{name} imports {child}"
        for name, children in graph.items()
        if _level(name) is not None
        for child in children
        if _level(child) is not None and _level(child) > _level(name)
    )
    assert bad == []


def test_the_command_line_speaks_only_to_the_public_api_and_the_renderers():
    graph = _graph()
    # and the garbage collector's switch, which is the process's, not the API's
    allowed = ("vramplan.report", "vramplan.cli", "vramplan.collector")
    bad = sorted(
        f"{name} imports {child}"
        for name, children in graph.items()
        if _under(name, ("vramplan.cli",))
        for child in children
        if child != "vramplan" and not _under(child, allowed)
    )
    assert bad == []


def test_no_private_name_crosses_a_module():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vramplan"):
                offenders += [
                    f"{_module_name(path)}: {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_") and a.name != "__version__"
                ]
    assert offenders == []


def test_the_public_api_is_curated():
    assert "Session" in vramplan.__all__
    for name in vramplan.__all__:
        assert hasattr(vramplan, name), name
    assert not any(name.startswith("_") and name != "__version__" for name in vramplan.__all__)


def test_no_subpackage_shadows_a_public_name():
    """Importing a submodule binds it on its parent package, so a subpackage named like a
    public function (``vramplan.plan``) would replace the function once it loads."""
    submodules = {
        _module_name(p).split(".")[1] for p in PACKAGE.rglob("*.py") if p.parent != PACKAGE
    }
    submodules |= {p.stem for p in PACKAGE.glob("*.py")}
    assert submodules.isdisjoint(set(vramplan.__all__) - {"__version__"})


def test_public_functions_stay_callable_after_the_stages_load():
    import subprocess
    import sys

    code = (
        "import vramplan, vramplan.session, vramplan.api\n"
        "assert callable(vramplan.plan) and callable(vramplan.measure), "
        "(vramplan.plan, vramplan.measure)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
