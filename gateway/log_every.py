"""A recurring log line, let through at most once in a while with the ones held back counted.

For events that are routine when they come many times a second (a rate limiter holding
collection back, a trainer's publications), but still worth a line now and then::

    swaps = LogEvery(30.0)
    held = swaps.passes()
    if held is not None:
        log.info("now serving version %d (%d more swaps since the last such line)", v, held)
"""

from __future__ import annotations

import time


class LogEvery:
    """Lets a line of one kind through at most once in ``seconds``; another kind at once."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._kind: str | None = None
        self._at = 0.0
        self._held = 0

    def passes(self, kind: str = "") -> int | None:
        """``None``: hold this line back (it is counted). Otherwise log it: how many lines
        of its kind were held back since the last one that passed (0 for a new kind)."""
        now = time.monotonic()
        if kind == self._kind and now - self._at < self.seconds:
            self._held += 1
            return None
        held = self._held if kind == self._kind else 0
        self._kind, self._at, self._held = kind, now, 0
        return held
