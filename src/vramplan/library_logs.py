"""Log records of the libraries underneath that a user of vramplan need not see, held
back around the call that makes them::

    with quiet_logger("bitsandbytes"):
        import_a_library_that_imports_it()
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_logger(name: str) -> Iterator[None]:
    """Only CRITICAL records of logger ``name`` (and its children) pass for the duration;
    its level is restored after.

    >>> logger = logging.getLogger("some.library")
    >>> with quiet_logger("some.library"):
    ...     logger.getEffectiveLevel() == logging.CRITICAL
    True
    >>> logger.level == logging.NOTSET
    True
    """
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
