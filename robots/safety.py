"""Safety on real robots: command limits, the action watchdog and the e-stop latch.

Everything here is plain Python and numpy, used by :mod:`robots.ros2` on every command
whatever the policy sends::

    limits = CommandLimits(config.safety, low, high, control_hz=20.0)
    command, clamped = limits.position(target, previous)    # [n, joints], bool[n]
    watchdog = Watchdog(0.5); watchdog.feed(now)             # every action
    if watchdog.expired(now): hold()                          # True once per silence
    latch = EstopLatch(); latch.set("topic", True)            # engaged until every source releases

Every clamp, watchdog trip and e-stop is counted (``counts``) and logged: the first of
each kind at once, then a summary at most every ``report_interval_s`` so that a policy
pushing against a limit at 500 Hz does not flood the log.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

log = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, kw_only=True)
class SafetyConfig:
    """Limits enforced on every command (``env.options.safety``)."""

    position_low: tuple[float, ...] | None = None
    """Lower joint position limits (rad), one per joint; default: the task's joint limits."""
    position_high: tuple[float, ...] | None = None
    """Upper joint position limits (rad), one per joint; default: the task's joint limits."""
    max_velocity: float = 4.0
    """Largest joint speed (rad/s): a position command moves at most this / control rate per step; velocity commands are clipped to it."""
    max_step_change: float = 0.2
    """Largest change of a joint's position command in one control step (rad)."""
    watchdog_timeout_s: float = 0.5
    """Hold the robot when no action arrived for this long (s)."""
    report_interval_s: float = 10.0
    """Shortest interval between two clamp summaries in the log (s)."""

    def __post_init__(self) -> None:
        for name in ("position_low", "position_high"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(float(v) for v in value))
        if (self.position_low is None) != (self.position_high is None):
            raise ValueError("position_low and position_high must be given together")
        if (
            self.position_low is not None
            and self.position_high is not None
            and (
                len(self.position_low) != len(self.position_high)
                or any(lo >= hi for lo, hi in zip(self.position_low, self.position_high))
            )
        ):
            raise ValueError(
                f"position_low must be below position_high element by element, got "
                f"{list(self.position_low)} and {list(self.position_high)}"
            )
        for name in ("max_velocity", "max_step_change", "watchdog_timeout_s", "report_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


class Counts:
    """Named event counters with rate-limited logging."""

    def __init__(self, report_interval_s: float, what: str) -> None:
        self.counts: Counter[str] = Counter()
        self._since_report: Counter[str] = Counter()
        self._interval = report_interval_s
        self._last_report = time.monotonic()
        self._what = what

    def add(self, kind: str, n: int = 1, detail: str = "") -> None:
        if n <= 0:
            return
        if self.counts[kind] == 0:
            log.warning("%s: first %s clamp%s (further ones are counted)", self._what, kind, detail)
        self.counts[kind] += n
        self._since_report[kind] += n
        now = time.monotonic()
        if now - self._last_report >= self._interval:
            summary = ", ".join(f"{k} {v}" for k, v in sorted(self._since_report.items()))
            log.warning("%s: clamps in the last %.0f s: %s", self._what, now - self._last_report, summary)
            self._since_report.clear()
            self._last_report = now


class CommandLimits:
    """Clamps position or velocity commands to the configured limits and counts each clamp."""

    def __init__(
        self,
        config: SafetyConfig,
        low: tuple[float, ...],
        high: tuple[float, ...],
        *,
        control_hz: float,
        what: str = "robot",
    ) -> None:
        self.config = config
        self.low = np.asarray(config.position_low if config.position_low is not None else low, dtype=float)
        self.high = np.asarray(
            config.position_high if config.position_high is not None else high, dtype=float
        )
        if self.low.shape != (len(low),):
            raise ValueError(
                f"safety.position_low/high must have {len(low)} elements (one per joint), got {self.low.size}"
            )
        self.max_change = min(config.max_step_change, config.max_velocity / control_hz)
        self.counts = Counts(config.report_interval_s, what)

    def position(
        self, target: npt.ArrayLike, previous: npt.ArrayLike
    ) -> tuple[FloatArray, npt.NDArray[np.bool_]]:
        """``target`` within the position limits and at most ``max_change`` from ``previous``."""
        # ufuncs rather than np.clip: this runs at every control step on tiny arrays,
        # where np.clip's Python wrapper costs more than the arithmetic.
        target = np.asarray(target, dtype=float)
        previous = np.asarray(previous, dtype=float)
        in_range = np.minimum(np.maximum(target, self.low), self.high)
        wanted = in_range - previous
        # Moving from ``previous`` toward an in-range target: a command that starts
        # beyond a limit is walked back in, one step at a time, never further out.
        step = np.minimum(np.maximum(wanted, -self.max_change), self.max_change)
        pos_hit = (in_range != target).any(axis=-1)
        step_hit = (step != wanted).any(axis=-1)
        if pos_hit.any():
            self.counts.add("position", int(pos_hit.sum()))
        if step_hit.any():
            self.counts.add("step", int(step_hit.sum()), f" (max {self.max_change:.3f} rad per step)")
        return previous + step, pos_hit | step_hit

    def velocity(
        self, velocity: npt.ArrayLike, position: npt.ArrayLike
    ) -> tuple[FloatArray, npt.NDArray[np.bool_]]:
        """Velocities within ``max_velocity``, never driving a joint further past a position limit."""
        velocity = np.asarray(velocity, dtype=float)
        position = np.asarray(position, dtype=float)
        vmax = self.config.max_velocity
        out = np.clip(velocity, -vmax, vmax)
        speed_hit = np.any(out != velocity, axis=-1)
        outward = ((position >= self.high) & (out > 0)) | ((position <= self.low) & (out < 0))
        out = np.where(outward, 0.0, out)
        pos_hit = np.any(outward, axis=-1)
        self.counts.add("velocity", int(speed_hit.sum()))
        self.counts.add("position", int(pos_hit.sum()))
        return out, speed_hit | pos_hit


class Watchdog:
    """Trips once when ``feed`` has not been called for ``timeout_s``; re-arms on the next feed."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.last_feed: float | None = None
        self.tripped = False
        self.trips = 0

    def feed(self, now: float) -> bool:
        """Record an action; True when this ends a trip (actions resumed)."""
        self.last_feed = now
        if self.tripped:
            self.tripped = False
            return True
        return False

    def pause(self) -> None:
        """Stop watching until the next feed (a reset routine or an e-stop commands the robot)."""
        self.last_feed = None

    def expired(self, now: float) -> bool:
        """True exactly once per silence longer than the timeout."""
        if self.tripped or self.last_feed is None or now - self.last_feed < self.timeout_s:
            return False
        self.tripped = True
        self.trips += 1
        return True


class EstopLatch:
    """E-stop state from several sources (the ROS topic, the gateway): engaged while any is."""

    def __init__(self) -> None:
        self.sources: dict[str, bool] = {}
        self.engagements = 0

    @property
    def engaged(self) -> bool:
        return any(self.sources.values())

    def set(self, source: str, engaged: bool) -> bool:
        """Record ``source``'s state; True when the overall state changed."""
        before = self.engaged
        self.sources[source] = engaged
        if self.engaged and not before:
            self.engagements += 1
        return self.engaged != before

    def describe(self) -> dict[str, Any]:
        return {"engaged": self.engaged, "sources": dict(self.sources), "engagements": self.engagements}
