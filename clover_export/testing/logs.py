"""The progress lines the toolchain logs, collected for a test (`caplog` cannot serve a module-scoped fixture)."""

from __future__ import annotations

import contextlib
import logging


class _Lines(logging.Handler):
    def __init__(self, lines: list[str]):
        super().__init__(logging.INFO)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def log_lines(name: str = "clover_export"):
    """The INFO lines (and above) the `name` logger tree logs while the block runs, as the CLI prints them."""
    lines: list[str] = []
    logger, handler = logging.getLogger(name), _Lines(lines)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
