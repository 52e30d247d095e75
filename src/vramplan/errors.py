"""Errors a user can cause.

The command line turns a ``UserError`` into one line on stderr and exit code 2::

    raise UserError("batch size must be a positive integer, got 0")
"""

from __future__ import annotations


class UserError(ValueError):
    """A problem with what the user asked for (a name, a path, a shape, a flag)."""
