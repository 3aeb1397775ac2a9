"""Logging for the lines a user should see (an elastic job's rounds, autotune's progress).

The library only logs. A progress logger shows its INFO lines on stdout when nothing else
would: while the application has configured no logging (no handler on the root logger:
a notebook, a plain script), one handler of ours writes them; once it has, the lines
propagate to its handlers like any other record and ours stays quiet, so nothing is shown
twice. They are INFO records whatever the root level: lines the user would otherwise miss.
"""

from __future__ import annotations

import logging
import sys


class _WhenUnconfigured(logging.StreamHandler):
    """Writes to stdout only while the root logger has no handler of its own."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):  # stdout as it is now (a notebook or a test may replace it)
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def progress_logger(name: str) -> logging.Logger:
    """`logging.getLogger(name)`, its INFO lines shown as `_WhenUnconfigured` says.

    Args:
        name: the logger's name, under `raytrain_x` (for example `raytrain_x.elastic`).
    """
    logger = logging.getLogger(name)
    if not any(isinstance(h, _WhenUnconfigured) for h in logger.handlers):
        logger.addHandler(_WhenUnconfigured())
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
    return logger


# Horovod's log levels (`HOROVOD_LOG_LEVEL`, horovodrun's `--log-level`) as Python's
_LEVELS = {"TRACE": logging.DEBUG, "DEBUG": logging.DEBUG, "INFO": logging.INFO,
           "WARNING": logging.WARNING, "ERROR": logging.ERROR, "FATAL": logging.CRITICAL}


def apply_log_level(level: str) -> None:
    """Sets the level of raytrain-x's loggers in this process (`RAYTRAIN_X_LOG_LEVEL`,
    `--log-level`); an empty `level` leaves them as they are."""
    if level:
        logging.getLogger("raytrain_x").setLevel(_LEVELS[level.upper()])
