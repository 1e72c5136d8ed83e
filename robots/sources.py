"""Observation sources: ROS 2 messages to arrays, kept with their stamps, read aligned.

Each subscribed topic of each robot has a :class:`History` of its recent messages,
already converted to arrays by the executor thread that received them. At a control
step :func:`align` picks one message per topic so that their header stamps agree::

    histories = [joint_states, camera]                  # History objects
    chosen, spread = align(histories)                   # one Entry per topic
    stale = time.time() - min(e.stamp for e in chosen) > max_age_s
    misaligned = spread > max_skew_s

The anchor is the newest stamp that *every* topic has reached (the newest message of
the topic that lags most); every other topic contributes its message nearest to it.
So a 30 Hz camera and 500 Hz joint states give the joint state taken when the picture
was, not the newest one. Converters are duck-typed on message attributes, so this
module imports nothing from ROS and is tested without it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from robots.topic_map import IMAGE, JOINT_STATE, POSE, WRENCH, Source


class TopicMapMismatch(ValueError):
    """The robot publishes something the topic map does not describe (a missing joint...)."""


@dataclass(frozen=True)
class Entry:
    """One received message, converted."""

    stamp: float
    """Header stamp (s, ROS time = system time), or the receive time for headerless messages."""
    received: float
    """``time.monotonic()`` at arrival."""
    values: dict[str, Any]
    """Observation key -> array (images: the raw message fields, converted when read)."""


class History:
    """The last ``size`` entries of one topic; appended by one thread, read by another."""

    def __init__(self, size: int) -> None:
        self._entries: deque[Entry] = deque(maxlen=size)
        self.count = 0
        self.changed = threading.Condition()

    def append(self, entry: Entry) -> None:
        with self.changed:
            self._entries.append(entry)
            self.count += 1
            self.changed.notify_all()

    def snapshot(self) -> list[Entry]:
        with self.changed:
            return list(self._entries)

    def latest(self) -> Entry | None:
        with self.changed:
            return self._entries[-1] if self._entries else None

    def newest(self) -> Entry:
        """The newest entry; the history must not be empty."""
        with self.changed:
            return self._entries[-1]

    def mean_interval(self) -> float:
        """Mean time (s) between the arrivals of the kept entries; 0 with fewer than two."""
        with self.changed:
            n = len(self._entries)
            return (self._entries[-1].received - self._entries[0].received) / (n - 1) if n > 1 else 0.0

    def latest_received(self) -> float:
        """Arrival time (monotonic) of the newest entry; -inf when empty."""
        with self.changed:
            return self._entries[-1].received if self._entries else float("-inf")

    def wait_newer(self, after: float, deadline: float, spin: Callable[[float], None] | None = None) -> bool:
        """Wait until the newest entry was received at or after ``after`` (monotonic clock).

        With ``spin`` (:meth:`robots.ros_io.RosSession.borrow`) the caller's thread runs
        the subscriptions' callbacks itself while it waits, instead of being woken by
        the thread that runs them.
        """
        while True:
            with self.changed:
                if self._entries and self._entries[-1].received >= after:
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                if spin is None:
                    self.changed.wait(remaining)
                    continue
            spin(remaining)

    def clear(self) -> None:
        with self.changed:
            self._entries.clear()


def align(histories: Sequence[Sequence[Entry]]) -> tuple[list[Entry], float]:
    """One entry per history with stamps as close as possible; and their spread (s).

    Every history must be non-empty.
    """
    anchor = min(h[-1].stamp for h in histories)
    chosen = [min(h, key=lambda e: abs(e.stamp - anchor)) for h in histories]
    stamps = [e.stamp for e in chosen]
    return chosen, max(stamps) - min(stamps)


def stamp_of(msg: Any) -> float:
    stamp = msg.header.stamp
    return float(stamp.sec) + float(stamp.nanosec) * 1e-9


Converter = Callable[[Any], dict[str, Any]]


def converter(source: Source, joints: Sequence[str], where: str) -> Converter:
    """A function turning one message of ``source`` into ``{key: array}``."""
    if source.type == JOINT_STATE:
        return JointStateConverter(source, joints, where)
    if source.type == IMAGE:
        key = source.key
        return lambda msg: {
            key: (int(msg.height), int(msg.width), str(msg.encoding), int(msg.step), msg.data)
        }
    if source.type == WRENCH:
        key = source.key

        def wrench(msg: Any) -> dict[str, Any]:
            f, t = msg.wrench.force, msg.wrench.torque
            return {key: np.array([f.x, f.y, f.z, t.x, t.y, t.z], dtype=np.float32)}

        return wrench
    if source.type == POSE:
        key = source.key

        def pose(msg: Any) -> dict[str, Any]:
            p, q = msg.pose.position, msg.pose.orientation
            return {key: np.array([p.x, p.y, p.z, q.x, q.y, q.z, q.w], dtype=np.float32)}

        return pose
    key, size = source.key, source.size

    def float_array(msg: Any) -> dict[str, Any]:
        data = np.asarray(msg.data, dtype=np.float32)
        if data.shape != (size,):
            raise TopicMapMismatch(
                f"{where}: {source.topic} carries {data.size} numbers, the map says size {size}"
            )
        return {key: data}

    return float_array


class JointStateConverter:
    """Picks the map's joints, in the map's order, out of a JointState by name."""

    def __init__(self, source: Source, joints: Sequence[str], where: str) -> None:
        self.source, self.joints, self.where = source, tuple(joints), where
        self._names: tuple[str, ...] | None = None
        self._index: npt.NDArray[np.intp] | None = None

    def __call__(self, msg: Any) -> dict[str, Any]:
        names = tuple(msg.name)
        if names != self._names:
            self._index = self._lookup(names)
            self._names = names
        out: dict[str, Any] = {}
        for key, field_name in self.source.fields.items():
            values = getattr(msg, field_name)
            if len(values) != len(names):
                raise TopicMapMismatch(
                    f"{self.where}: {self.source.topic} publishes {len(values)} {field_name} value(s) for "
                    f"{len(names)} joint(s); the map reads {key!r} from {field_name}"
                )
            out[key] = np.asarray(values, dtype=np.float32)[self._index]
        return out

    def _lookup(self, names: tuple[str, ...]) -> npt.NDArray[np.intp]:
        missing = [j for j in self.joints if j not in names]
        if missing:
            raise TopicMapMismatch(
                f"{self.where}: joint(s) {missing} named in the topic map are not published on "
                f"{self.source.topic} (it publishes {list(names)})"
            )
        return np.array([names.index(j) for j in self.joints], dtype=np.intp)


_CHANNELS = {
    "rgb8": (3, False),
    "bgr8": (3, True),
    "rgba8": (4, False),
    "bgra8": (4, True),
    "mono8": (1, False),
}


def image_array(
    raw: tuple[int, int, str, int, Any], shape: tuple[int, int], where: str
) -> npt.NDArray[np.uint8]:
    """An Image message's fields as uint8 ``[H, W, 3]`` RGB, resized (nearest) to ``shape``."""
    height, width, encoding, step, data = raw
    if encoding not in _CHANNELS:
        raise TopicMapMismatch(f"{where}: image encoding {encoding!r} is not one of {sorted(_CHANNELS)}")
    channels, bgr = _CHANNELS[encoding]
    buf = np.frombuffer(data, dtype=np.uint8)
    if buf.size < height * step or step < width * channels:
        raise TopicMapMismatch(f"{where}: image of {buf.size} bytes is too small for {height}x{step}")
    img = buf[: height * step].reshape(height, step)[:, : width * channels].reshape(height, width, channels)
    if channels == 1:
        img = np.repeat(img, 3, axis=2)
    else:
        img = img[..., 2::-1] if bgr else img[..., :3]
    if (height, width) != shape:
        rows = (np.arange(shape[0]) * height // shape[0]).astype(np.intp)
        cols = (np.arange(shape[1]) * width // shape[1]).astype(np.intp)
        img = img[rows][:, cols]
    return np.ascontiguousarray(img)
