"""The pause between attempts to reach Redis again, shared by the relay and the worker."""

from __future__ import annotations

import logging
from typing import Callable

from .. import metrics

# First pause after a failure, and the cap the doubling stops at.
FIRST_S = 0.1
MAX_S = 2.0


class Backoff:
    """``failed()`` gives the pause before the next attempt (0.1 s, doubling up to the
    cap); ``succeeded()`` starts over. Pure: the caller sleeps its own way (gevent or not)."""

    def __init__(self, first_s: float = FIRST_S, max_s: float = MAX_S):
        self.first_s = first_s
        self.max_s = max_s
        self._next = first_s

    def failed(self) -> float:
        pause = self._next
        self._next = min(self._next * 2, self.max_s)
        return pause

    def succeeded(self) -> None:
        self._next = self.first_s

    def wait(self, log: logging.Logger, what: str, exc: Exception,
             sleep: Callable[[float], object]) -> None:
        """After a failed attempt to reach Redis: say so, count it
        (``cosyvoice_redis_errors_total``) and pause before the next one."""
        pause = self.failed()
        log.warning("%s, retrying in %.1fs: %s", what, pause, exc)
        metrics.REDIS_ERRORS.inc()
        sleep(pause)
