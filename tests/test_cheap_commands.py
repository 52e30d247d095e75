"""Commands that need no trace import neither torch nor a model library.

Each command runs in a fresh interpreter (the test process has torch loaded already); the
child reports which heavy modules were in ``sys.modules`` after each command. A check of
what was imported, not of how long it took.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "torchvision", "timm")
CHEAP = [
    ["calc", "--params", "20M", "--activations-per-sample", "1M", "--batch-size", "8"],
    ["calc", "--params", "7B", "--json"],
    ["layers", str(ROOT / "examples" / "vgg16.yaml")],
    ["llm", "hf:meta-llama-3-8b", "--seq-len", "4096", "--json"],
    ["gpus"],
    ["gpus", "--json"],
    ["models", "hf"],
    ["models", "hf", "--search", "llama 3.2"],
    ["llm", "meta-llama/Llama-3.2-3B", "--json"],
    ["--help"],
    ["estimate", "--help"],
    ["max-batch", "--help"],
    ["plan", "--help"],
    ["daemon", "status"],
]

CHILD = """
import contextlib, io, json, sys
from vramplan.cli import main
heavy = {heavy!r}
seen = {{}}
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    loaded = sorted(m for m in heavy if m in sys.modules)
    seen[" ".join(argv)] = {{"code": code, "heavy": loaded, "printed": len(out.getvalue())}}
print(json.dumps(seen))
"""


def _run_child(code: str, *args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_cheap_commands_import_no_torch():
    seen = _run_child(CHILD.format(heavy=HEAVY), json.dumps(CHEAP))
    assert len(seen) == len(CHEAP)
    for command, result in seen.items():
        assert result["code"] in (0, None), (command, result)
        assert result["printed"] > 0, command
        assert result["heavy"] == [], f"`vramplan {command}` imported {result['heavy']}"


def test_the_package_root_and_the_answers_without_tracing_import_no_torch():
    code = (
        "import json, sys, vramplan\n"
        "est = vramplan.calc('20M', activations_per_sample='1M', batch_size=4)\n"
        "llm = vramplan.llm('hf:gpt2', seq_len=128)\n"
        "names = vramplan.models('hf'); cards = vramplan.gpus()\n"
        "r = vramplan.Recipe(batch_size=2); e = vramplan.UserError\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    assert _run_child(code) == []


def test_a_command_imports_only_its_own_command_module():
    """typer builds the options of every registered command on each call, so a named
    command registers its own module only; ``--help`` and a misspelt command, all."""
    code = (
        "import contextlib, io, json, sys\n"
        "from vramplan.cli import main\n"
        "seen = {}\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), "
        "contextlib.redirect_stderr(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        main(argv)\n"
        "    seen[argv[0]] = sorted(m for m in sys.modules if m.endswith('_cmd'))\n"
        "print(json.dumps(seen))"
    )
    gpus = _run_child(code, json.dumps([["gpus"]]))["gpus"]
    assert gpus == ["vramplan.cli.gpus_cmd"]
    calc = _run_child(code, json.dumps([["calc", "--params", "7B"]]))["calc"]
    assert calc == ["vramplan.cli.analytic_cmd"]
    misspelt = _run_child(code, json.dumps([["estimat"]]))["estimat"]
    assert {"vramplan.cli.estimate_cmd", "vramplan.cli.plan_cmd"} <= set(misspelt)
