"""Logging a failure once, with a bounded traceback.

A RecursionError's traceback is a thousand frames (about 176 KB per request); the log
needs the innermost frames and the message, not a copy of the stack per request.
"""

from __future__ import annotations

import logging
import time
import traceback

MAX_FRAMES = 12  # innermost frames kept
MAX_CHARS = 4000  # of the whole record


def log_failure(logger: logging.Logger, what: str, exc: BaseException) -> None:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-MAX_FRAMES))
    if len(text) > MAX_CHARS:
        text = text[: MAX_CHARS // 2] + "\n[...]\n" + text[-MAX_CHARS // 2 :]
    logger.error("%s: %s", what, text.rstrip())


class Stopwatch:
    """Where startup time goes: each `lap` logs the phase and its seconds at debug level."""

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self.logger, self.what = logger, what
        self.start = self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.logger.debug("%s: %s took %.2f s (%.2f s so far)", self.what, phase, now - self.last, now - self.start)
        self.last = now
