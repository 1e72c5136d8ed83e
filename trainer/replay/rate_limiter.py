"""A Reverb-style rate limiter: minimum size to sample and a samples-per-insert ratio.

With ratio ``spi``, minimum size ``m`` and error buffer ``e`` the limiter keeps
``diff = inserts * spi - samples`` inside ``[m * spi - e, m * spi + e]``: inserts wait
while ``diff`` would pass the upper edge (the trainer is behind), samples wait while it
would pass the lower edge (the actors are behind). Nothing is sampled before ``m``
items were inserted. Windows narrower than ``2 * max(1, spi)`` are refused at config
time because they can leave both sides waiting for each other::

    limiter = RateLimiter(min_size_to_sample=100, samples_per_insert=4.0, error_buffer=400)
    if limiter.can_insert(64):
        limiter.inserted(64)
    if limiter.can_sample(256):
        limiter.sampled(256)
"""

from __future__ import annotations

from typing import Any


class RateLimiter:
    """Counts inserts and sampled items and says which side may go on."""

    def __init__(
        self, *, min_size_to_sample: int, samples_per_insert: float | None, error_buffer: float
    ) -> None:
        self.min_size = min_size_to_sample
        self.spi = samples_per_insert
        offset = (samples_per_insert or 0.0) * min_size_to_sample
        self.min_diff = offset - error_buffer if samples_per_insert else float("-inf")
        self.max_diff = offset + error_buffer if samples_per_insert else float("inf")
        self.inserts = 0
        self.samples = 0
        self.blocked_inserts = 0
        self.blocked_samples = 0

    def diff(self, inserts: int = 0, samples: int = 0) -> float:
        if self.spi is None:
            return 0.0
        return (self.inserts + inserts) * self.spi - (self.samples + samples)

    def can_insert(self, n: int = 1) -> bool:
        if self.inserts + n <= self.min_size or self.spi is None:
            return True
        return self.diff(inserts=n) <= self.max_diff

    def insertable(self, want: int) -> int:
        """How many of ``want`` items may be inserted now."""
        if self.spi is None:
            return want
        free_below_min = max(0, self.min_size - self.inserts)
        room = int((self.max_diff - self.diff()) // self.spi) if self.spi else want
        return max(0, min(want, max(room, free_below_min)))

    def release(self) -> None:
        """Stop holding inserts back (no one samples any more, e.g. the trainer finished)."""
        self.spi = None
        self.min_diff, self.max_diff = float("-inf"), float("inf")

    def can_sample(self, n: int = 1) -> bool:
        if self.inserts < self.min_size:
            return False
        return self.diff(samples=n) >= self.min_diff

    def inserted(self, n: int) -> None:
        self.inserts += n

    def sampled(self, n: int) -> None:
        self.samples += n

    def restored(self, inserts: int) -> None:
        """After a restart: ``inserts`` items are back, counted as balanced (diff at its middle)."""
        self.inserts = inserts
        if self.spi is not None and inserts >= self.min_size:
            self.samples = int(inserts * self.spi - self.spi * self.min_size)

    def state(self) -> dict[str, Any]:
        """What ``metrics.jsonl`` shows for this limiter."""
        return {
            "inserts": self.inserts,
            "samples": self.samples,
            "diff": round(self.diff(), 2) if self.spi is not None else None,
            "min_diff": self.min_diff if self.spi is not None else None,
            "max_diff": self.max_diff if self.spi is not None else None,
            "can_sample": self.can_sample(1),
            "can_insert": self.can_insert(1),
            "blocked_inserts": self.blocked_inserts,
            "blocked_samples": self.blocked_samples,
        }

    def describe_wait(self, n: int) -> str:
        """Why a sample of ``n`` waits, in words."""
        if self.inserts < self.min_size:
            return (
                f"{self.inserts} items inserted, {self.min_size} needed before sampling (min_size_to_sample)"
            )
        return (
            f"samples_per_insert {self.spi}: {self.inserts} inserts allow "
            f"{int(self.inserts * self.spi - self.min_diff) if self.spi else 0} sampled items, "
            f"{self.samples} sampled already, {n} asked"
        )
