"""Progress lines: shown on stdout while the application configured no logging, handed to
its handlers once it has, never both."""

from __future__ import annotations

import logging

from raytrain_x.common.logs import progress_logger


def test_progress_lines_show_once_whether_or_not_logging_is_configured(capsys):
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers.clear()  # pytest's own capture handlers: an application with no logging
    try:
        log = progress_logger("raytrain_x.test_logs.progress")
        log.info("round 1 formed")
        assert capsys.readouterr().out == "round 1 formed\n"
        got: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: got.append(record.getMessage())
        root.addHandler(handler)  # the application configures logging
        log.info("round 2 formed")
        assert got == ["round 2 formed"]  # its handler has it, at INFO
        assert capsys.readouterr().out == ""  # and ours stays quiet
        assert progress_logger("raytrain_x.test_logs.progress") is log
        assert len(log.handlers) == 1  # asking again adds no second handler
    finally:
        root.handlers[:] = saved
