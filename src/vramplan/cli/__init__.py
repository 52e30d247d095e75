"""The ``vramplan`` command. Thin: parse, call the API, render.

Errors a user can cause print one line on stderr and exit with code 2::

    $ vramplan estimate torchvision:nope
    vramplan: error: unknown torchvision model 'nope'; did you mean ...
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import os
import sys
import warnings
from typing import NoReturn

import typer

try:  # typer >= 0.29 vendors click
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover - older typer uses click itself
    from click import exceptions as click_exceptions

from vramplan import UserError
from vramplan.cli.app import app
from vramplan.cli.daemon.client import forward, start_after
from vramplan.collector import paused

EXIT_USER_ERROR = 2
EXIT_INTERNAL_ERROR = 1


COMMAND_MODULES = {
    "calc": "analytic_cmd",
    "layers": "analytic_cmd",
    "llm": "analytic_cmd",
    "calibrate": "calibrate_cmd",
    "check": "check_cmd",
    "daemon": "daemon_cmd",
    "estimate": "estimate_cmd",
    "gpus": "gpus_cmd",
    "measure": "measure_cmd",
    "models": "models_cmd",
    "max-batch": "plan_cmd",
    "plan": "plan_cmd",
    "serve": "serve_cmd",
}
"""Each command and the module that registers it on ``app``."""


def register_commands(argv: list[str] | tuple = ()) -> None:
    """Import the module of the command ``argv`` names, or every command module when it
    names none (``--help``, a misspelt command): typer builds the options of each command
    registered, which for ``estimate`` and ``plan`` is most of a cheap command's time."""
    named = COMMAND_MODULES.get(argv[0]) if argv else None
    for module in [named] if named else dict.fromkeys(COMMAND_MODULES.values()):
        importlib.import_module(f"vramplan.cli.{module}")


def fail(message: str) -> None:
    """Print one error line and exit with code 2."""
    print(f"vramplan: error: {message}", file=sys.stderr)
    raise SystemExit(EXIT_USER_ERROR)


OTHER_SPELLINGS = {
    "--precomputed-latents": "--diffusion-encoders precomputed (the default)",
    "--frozen-encoders": "--diffusion-encoders frozen",
}
"""Flags as other tools or write-ups spell them, and vramplan's words for the same thing."""


def unknown_option(name: str, possibilities, options=()) -> str:
    """The refusal of an unknown flag, suggesting only flags that look like it, or the
    command's own flag (among ``options``) for a spelling of another tool.

    >>> unknown_option("--gpus", ["--gpu", "--tp", "--units"])
    'No such option: --gpus; did you mean --gpu?'
    >>> unknown_option("--colour", ["--gpu", "--tp"])
    "No such option: --colour (see the command's --help)"
    >>> unknown_option("--frozen-encoders", [], ["--diffusion-encoders"])
    'No such option: --frozen-encoders; vramplan spells it --diffusion-encoders frozen'
    """
    if name in OTHER_SPELLINGS and OTHER_SPELLINGS[name].split()[0] in options:
        return f"No such option: {name}; vramplan spells it {OTHER_SPELLINGS[name]}"
    bare = {option.lstrip("-"): option for option in possibilities}
    wanted = name.lstrip("-")
    close = [b for b in bare if wanted and b.startswith(wanted)][:2]
    close = close or difflib.get_close_matches(wanted, list(bare), n=2, cutoff=0.7)
    if close:
        return f"No such option: {name}; did you mean {' or '.join(bare[c] for c in close)}?"
    return f"No such option: {name} (see the command's --help)"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``vramplan`` script. Warnings from the libraries underneath
    (torch, transformers) are held back: after a refusal only the one error line is
    printed, after an answer each distinct warning is printed once. The cyclic garbage
    collector is off until the first trace (``collector``). Run as the script (no
    ``argv``), a command that traces goes to the warm daemon of this environment where one
    listens (``vramplan daemon start``; under ``VRAMPLAN_DAEMON=auto`` one is started after a
    command that found none); the script's process then ends at once (``_leave``)."""
    environ = dict(os.environ)  # as the user set it: the libraries may add to it
    if argv is None and (code := forward(sys.argv[1:], environ)) is not None:
        return code
    with warnings.catch_warnings(record=True) as caught, paused():
        warnings.simplefilter("default")
        code = _run(argv)
    if argv is None:
        start_after(sys.argv[1:], environ)
    seen = set()
    for warning in caught:
        text = " ".join(str(warning.message).split())
        if text not in seen:
            seen.add(text)
            print(f"vramplan: warning: {text}", file=sys.stderr)
    if argv is None:
        _leave(code)
    return code


def _leave(code: int) -> NoReturn:
    """End the script's process with ``code`` without the interpreter's teardown, its output
    flushed: freeing torch's and the model library's objects one by one took 1.5 s after
    ``estimate hf:meta-llama-3-8b --seq-len 4096`` (a quarter of the command) and 2.6 s
    after its ``plan``, and nothing of vramplan's waits for it (its files are closed, its
    workers stopped, a daemon it starts runs on its own)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more to say
            stream.flush()
    os._exit(code)


def _run(argv: list[str] | None) -> int:
    register_commands(sys.argv[1:] if argv is None else argv)
    try:
        result = app(args=argv, standalone_mode=False, prog_name="vramplan")
    except UserError as exc:
        fail(str(exc))
    except click_exceptions.NoArgsIsHelpError:
        return 0
    except click_exceptions.NoSuchOption as exc:
        options = [o for p in exc.ctx.command.params for o in p.opts] if exc.ctx else []
        fail(unknown_option(exc.option_name, exc.possibilities or (), options))
    except click_exceptions.UsageError as exc:
        fail(exc.format_message().replace("\n", " "))
    except click_exceptions.ClickException as exc:
        fail(exc.format_message().replace("\n", " "))
    except typer.Exit as exc:
        return exc.exit_code
    except Exception as exc:  # a bug in vramplan, not the user's input: say so in one line
        if os.environ.get("VRAMPLAN_DEBUG"):
            raise
        reason = " ".join(str(exc).split())[:300]
        print(
            f"vramplan: internal error: {type(exc).__name__}: {reason} (a bug in vramplan: "
            "please report it with the command; VRAMPLAN_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL_ERROR
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
