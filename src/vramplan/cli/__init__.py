"""The ``vramplan`` command. Thin: parse, call the API, render.

Errors a user can cause print one line on stderr and exit with code 2::

    $ vramplan estimate torchvision:nope
    vramplan: error: unknown torchvision model 'nope'; did you mean ...
"""

from __future__ import annotations

import sys

import typer

try:  # typer >= 0.29 vendors click
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover - older typer uses click itself
    from click import exceptions as click_exceptions

from vramplan import UserError
from vramplan.cli.app import app

EXIT_USER_ERROR = 2


def _register_commands() -> None:
    from vramplan.cli import (
        analytic_cmd,  # noqa: F401
        calibrate_cmd,  # noqa: F401
        estimate_cmd,  # noqa: F401
        gpus_cmd,  # noqa: F401
        measure_cmd,  # noqa: F401
        models_cmd,  # noqa: F401
        plan_cmd,  # noqa: F401
    )


def fail(message: str) -> None:
    """Print one error line and exit with code 2."""
    print(f"vramplan: error: {message}", file=sys.stderr)
    raise SystemExit(EXIT_USER_ERROR)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``vramplan`` script."""
    _register_commands()
    try:
        result = app(args=argv, standalone_mode=False, prog_name="vramplan")
    except UserError as exc:
        fail(str(exc))
    except click_exceptions.NoArgsIsHelpError:
        return 0
    except click_exceptions.UsageError as exc:
        fail(exc.format_message().replace("\n", " "))
    except click_exceptions.ClickException as exc:
        fail(exc.format_message().replace("\n", " "))
    except typer.Exit as exc:
        return exc.exit_code
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
