"""The pause between attempts to reach Redis again, shared by the relay and the worker."""

from __future__ import annotations

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
