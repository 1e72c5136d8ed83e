"""One robot's ROS 2 endpoints: subscriptions into stamped histories, and its command topic.

:class:`RobotLink` is what :class:`robots.ros2.Ros2Backend` holds per robot (one per
namespace); :class:`LoopStats` is the control loop's bookkeeping (periods, jitter,
flags), reported in the log and in ``stats_file``. Importing this module imports rclpy.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
from geometry_msgs.msg import PoseStamped
from rclpy.duration import Duration
from rclpy.node import Node
from std_msgs.msg import Float64MultiArray
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from robots.ros_io import message_class, qos_profile, resolve_topic, time_msg
from robots.sources import Entry, History, TopicMapMismatch, converter, stamp_of
from robots.topic_map import TRAJECTORY, Source, TopicMap

log = logging.getLogger(__name__)


class RobotLink:
    """Subscriptions, histories and the command publisher of the robot at ``namespace``."""

    def __init__(
        self, node: Node, topic_map: TopicMap, namespace: str, sources: list[Source], history: int
    ) -> None:
        self.namespace = namespace
        self.map = topic_map
        self.sources = sources
        self.histories = [History(history) for _ in sources]
        self.error: TopicMapMismatch | None = None
        """A message that contradicts the topic map (raised by the backend)."""
        self.primary = sources.index(topic_map.primary) if topic_map.primary in sources else 0
        self.topics = [resolve_topic(namespace, s.topic) for s in sources]
        where = f"robot {namespace!r}, topic map {topic_map.name}"
        for source, topic, hist in zip(sources, self.topics, self.histories):
            # Messages name the topic as resolved for this robot.
            convert = converter(dataclasses.replace(source, topic=topic), topic_map.joints, where)
            node.create_subscription(
                message_class(source.type),
                topic,
                self._callback(source, convert, hist),
                qos_profile(source.qos),
            )
        sink = topic_map.action
        self.command_topic = resolve_topic(namespace, sink.topic)
        self._trajectory = sink.type == TRAJECTORY
        msg_type = JointTrajectory if self._trajectory else Float64MultiArray
        self._publisher = node.create_publisher(msg_type, self.command_topic, qos_profile(sink.qos))
        self._target = None
        if topic_map.target is not None:
            self._target = node.create_publisher(
                PoseStamped,
                resolve_topic(namespace, topic_map.target.topic),
                qos_profile(topic_map.target.qos),
            )
        self.commands = 0

    def _callback(self, source: Source, convert: Any, hist: History) -> Any:
        stamped = source.stamped

        def on_message(msg: Any) -> None:
            received = time.monotonic()
            try:
                values = convert(msg)
            except TopicMapMismatch as exc:
                if self.error is None:
                    log.error("%s", exc)
                self.error = exc
                return
            hist.append(Entry(stamp_of(msg) if stamped else time.time(), received, values))

        return on_message

    def missing(self) -> list[str]:
        """Topics that have not delivered a message yet."""
        return [t for t, h in zip(self.topics, self.histories) if h.latest() is None]

    def latest(self, key: str) -> npt.NDArray[Any]:
        """The newest value of ``key`` from the primary joint state (no alignment)."""
        entry = self.histories[self.primary].latest()
        if entry is None:
            raise RuntimeError(f"robot {self.namespace!r}: no joint state received yet")
        value: npt.NDArray[Any] = entry.values[key]
        return value

    def silent_for(self, now: float) -> float:
        """Seconds since the primary joint state topic last delivered."""
        entry = self.histories[self.primary].latest()
        return float("inf") if entry is None else now - entry.received

    def wait_for_primary(
        self, after: float, deadline: float, spin: Callable[[float], None] | None = None
    ) -> bool:
        """Wait until a joint state received at or after ``after`` (monotonic) is there
        (``spin``: run the node's callbacks on this thread meanwhile)."""
        return self.histories[self.primary].wait_newer(after, deadline, spin)

    def state_interval(self) -> float:
        """Mean interval (s) between the last joint states, 0 when unknown."""
        return self.histories[self.primary].mean_interval()

    def publish(self, values: npt.NDArray[np.float64], period: float) -> None:
        data = values.tolist()
        if self._trajectory:
            msg = JointTrajectory()
            msg.header.stamp = time_msg(time.time())
            msg.joint_names = list(self.map.joints)
            msg.points = [
                JointTrajectoryPoint(positions=data, time_from_start=Duration(seconds=period).to_msg())
            ]
        else:
            msg = Float64MultiArray(data=data)
        self._publisher.publish(msg)
        self.commands += 1

    def publish_target(self, xy: npt.NDArray[np.float64]) -> None:
        if self._target is None:
            return
        msg = PoseStamped()
        msg.header.stamp = time_msg(time.time())
        msg.header.frame_id = "base"
        msg.pose.position.x, msg.pose.position.y = float(xy[0]), float(xy[1])
        msg.pose.orientation.w = 1.0
        self._target.publish(msg)


class LoopStats:
    """Control-loop periods and per-step flags, summarised as counts and percentiles."""

    def __init__(self, period: float, keep: int = 100_000) -> None:
        self.period = period
        self.ticks: deque[float] = deque(maxlen=keep)
        self.jitter_us: deque[float] = deque(maxlen=keep)
        self.counts: dict[str, int] = {"steps": 0, "overruns": 0, "stale": 0, "misaligned": 0}
        self._last_log = time.monotonic()

    def tick(self, now: float, new_run: bool = False) -> None:
        if self.ticks and not new_run:
            self.jitter_us.append(abs(now - self.ticks[-1] - self.period) * 1e6)
        self.ticks.append(now)

    def add(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def summary(self) -> dict[str, Any]:
        jitter = np.asarray(self.jitter_us) if self.jitter_us else np.zeros(1)
        return {
            **self.counts,
            "control_hz": round(1.0 / self.period, 3),
            "jitter_p50_us": round(float(np.percentile(jitter, 50)), 1),
            "jitter_p99_us": round(float(np.percentile(jitter, 99)), 1),
            "jitter_max_us": round(float(jitter.max()), 1),
        }

    def maybe_log(self, what: str, describe: Callable[[], dict[str, Any]], every_s: float = 30.0) -> None:
        """Log ``describe()`` at most every ``every_s``; it is only evaluated then (it is not cheap)."""
        now = time.monotonic()
        if now - self._last_log >= every_s:
            self._last_log = now
            log.info("%s: %s", what, describe())
