"""Options of the ``ros2`` backend (``env.options``), readable without ROS 2 installed.

The reach task's options come from :class:`sim_bridges.reach.ReachTaskOptions`, as
``mujoco_reach``'s do, so a sim config's ``env.options`` carries over, and :meth:`Ros2Config.spec` equals the
MuJoCo backend's spec for the same options (the same policy then drives both)::

    env:
      backend: ros2
      num_envs: 1                       # one robot per namespace in `namespaces`
      options:
        max_episode_steps: 50
        success_radius: 0.05
        topic_map: reach_arm            # robots/maps/reach_arm.yaml, a path, or inline
        namespaces: ["/"]
        safety: {max_velocity: 3.0, watchdog_timeout_s: 0.5}
        reset: {move_home: true, wait_for_operator: false}
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.episode import ArraySpec, EnvSpec
from robots.safety import SafetyConfig
from robots.topic_map import TopicMap, load_topic_map
from sim_bridges.reach import IMAGE_KEY, ReachTaskOptions

_TASK_KEYS = frozenset({"joint_pos", "joint_vel"})


@dataclass(frozen=True, kw_only=True)
class ResetConfig:
    """How an episode starts on the robot (``env.options.reset``)."""

    move_home: bool = True
    """Move to the episode's start posture (the task's home pose plus ``init_noise``) along a joint-space line, then wait until settled."""
    speed: float = 1.5
    """Joint speed of the move (rad/s); also bounded by ``safety.max_velocity``."""
    settle_tolerance: float = 0.03
    """Settled when every joint is this close to the start posture (rad) ..."""
    settle_velocity: float = 0.1
    """... and slower than this (rad/s)."""
    settle_timeout_s: float = 10.0
    """Give up waiting for the arm to settle after this long (logged and counted; the episode starts anyway)."""
    wait_for_operator: bool = False
    """Then hold until an operator says ready (``ready`` on the gateway's control socket)."""
    operator_timeout_s: float | None = None
    """Start anyway after this long without "ready" (None: wait as long as it takes)."""

    def __post_init__(self) -> None:
        for name in ("speed", "settle_tolerance", "settle_velocity", "settle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"reset.{name} must be > 0, got {getattr(self, name)!r}")
        if self.operator_timeout_s is not None and self.operator_timeout_s <= 0:
            raise ValueError(f"reset.operator_timeout_s must be > 0 or null, got {self.operator_timeout_s}")


@dataclass(frozen=True, kw_only=True)
class Ros2Config(ReachTaskOptions):
    """Options of the ``ros2`` backend: the reach task's (as ``mujoco_reach`` takes them) and the robot's."""

    task_name: Literal["reach"] = "reach"
    """The task whose rules (reward, success, targets) apply to the robot's observations."""
    control_hz: float = 20.0
    """Control rate (steps per second); must match the sim twin's for the specs to match."""
    clock: Literal["backend", "robot"] = "backend"
    """``backend``: steps tick on this process's clock; ``robot``: each step waits for the joint state due next (lowest latency when the robot publishes at or above the control rate)."""
    topic_map: str | dict[str, Any] = "reach_arm"
    """A map shipped in ``robots/maps`` (by name), a YAML file, or the map itself."""
    namespaces: tuple[str, ...] = ("/",)
    """One ROS namespace per robot; ``env.num_envs`` must equal their number."""
    extra_observations: tuple[str, ...] = ()
    """Observation keys of the topic map to add beyond the task's (the sim twin must produce them too)."""
    max_skew_s: float = 0.02
    """Largest stamp difference (s) between the messages of one observation; more marks the step ``misaligned``."""
    max_age_s: float = 0.1
    """Oldest acceptable observation (s, now minus its stamp); older marks the step ``stale``."""
    lost_timeout_s: float = 2.0
    """No joint state for this long (s) means the robot is gone: the step raises and the worker restarts."""
    connect_timeout_s: float = 60.0
    """How long start-up waits for every robot's first messages (s)."""
    history: int = 64
    """Messages kept per topic for stamp alignment."""
    safety: SafetyConfig = field(default_factory=SafetyConfig)
    """Position, velocity and step limits, and the action watchdog."""
    reset: ResetConfig = field(default_factory=ResetConfig)
    """The reset routine."""
    domain_id: int | None = None
    """ROS domain (None: ``ROS_DOMAIN_ID`` or 0)."""
    executor: Literal["events", "single_threaded"] = "events"
    """rclpy executor of the backend's nodes: ``events`` (C++, lowest latency) or ``single_threaded``."""
    node_name: str = "loopgate_robot"
    """Name of the backend's node (its safety node adds ``_safety``)."""
    stats_file: str | None = None
    """Write control-loop statistics (JSON) here when the backend closes."""
    parsed_map: TopicMap | None = field(default=None, init=False, repr=False, compare=False)
    """The loaded topic map (set when the config is validated)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        checks: list[tuple[str, bool, str]] = [
            ("control_hz", 0 < self.control_hz <= 2000, "in (0, 2000]"),
            ("max_skew_s", self.max_skew_s > 0, "> 0"),
            ("max_age_s", self.max_age_s > 0, "> 0"),
            ("lost_timeout_s", self.lost_timeout_s > self.max_age_s, f"> max_age_s ({self.max_age_s})"),
            ("connect_timeout_s", self.connect_timeout_s > 0, "> 0"),
            ("history", self.history >= 2, ">= 2"),
            (
                "namespaces",
                len(self.namespaces) >= 1 and len(set(self.namespaces)) == len(self.namespaces),
                "non-empty and unique",
            ),
            ("domain_id", self.domain_id is None or 0 <= self.domain_id <= 232, "in 0..232 or null"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"env.options.{name} must be {rule}, got {getattr(self, name)!r}")
        topic_map = load_topic_map(self.topic_map)
        object.__setattr__(self, "parsed_map", topic_map)
        needed = set(self.observation_keys())
        missing = sorted(k for k in needed if topic_map.source_of(k) is None)
        if missing:
            raise ValueError(
                f"env.options.topic_map ({topic_map.name}) has no source for observation(s) {missing}"
                + (
                    " (camera: true needs a sensor_msgs/Image source with key: image)"
                    if IMAGE_KEY in missing
                    else ""
                )
            )
        if len(topic_map.joints) != 3:
            raise ValueError(
                f"env.options.topic_map ({topic_map.name}): the reach task has 3 joints, the map names {len(topic_map.joints)}"
            )

    @property
    def map(self) -> TopicMap:
        assert self.parsed_map is not None
        return self.parsed_map

    def observation_keys(self) -> list[str]:
        """Keys read from the robot: the task's joint state, the camera, the extras."""
        keys = sorted(_TASK_KEYS) + ([IMAGE_KEY] if self.camera else [])
        return keys + [k for k in self.extra_observations if k not in keys]

    def spec(self) -> EnvSpec:
        """The task's spec (equal to ``mujoco_reach``'s for the same options) plus any extras."""
        spec = self.task_spec(control_hz=self.control_hz)
        if not self.extra_observations:
            return spec
        observation = dict(spec.observation)
        for key in self.extra_observations:
            source = self.map.source_of(key)
            assert source is not None
            dtype = "uint8" if source.type == "sensor_msgs/Image" else "float32"
            observation[key] = ArraySpec(
                dtype=dtype, shape=source.shape(len(self.map.joints), (self.image_height, self.image_width))
            )
        return dataclasses.replace(spec, observation=observation)
