"""Topic maps: how a robot's ROS 2 topics become observations and how actions reach it.

A topic map is a small YAML file (or an inline mapping in ``env.options.topic_map``)
naming the joints, the observation sources, the action sink and the e-stop topic. Topic
names without a leading ``/`` are resolved under each robot's namespace, so one map
serves several identical robots; absolute names (the e-stop) are shared by all::

    joints: [joint0, joint1, joint2]          # the task's joint order
    observations:
      - topic: joint_states
        type: sensor_msgs/JointState
        fields: {joint_pos: position, joint_vel: velocity}   # observation key -> field
      - topic: camera/image_raw
        type: sensor_msgs/Image
        key: image
    action:
      topic: forward_position_controller/commands
      type: std_msgs/Float64MultiArray      # or trajectory_msgs/JointTrajectory
      interface: position                   # or velocity (forward velocity controllers)
    estop:
      topic: /estop                         # std_msgs/Bool; true engages, false releases

Source types and the arrays they give (float32 unless said): ``sensor_msgs/JointState``
(one ``[n_joints]`` array per field, ordered by ``joints``, whatever order the robot
publishes in), ``sensor_msgs/Image`` (uint8 ``[H, W, 3]``, RGB), ``geometry_msgs/WrenchStamped``
(``[6]``: force xyz, torque xyz), ``geometry_msgs/PoseStamped`` (``[7]``: position xyz,
quaternion xyzw) and ``std_msgs/Float64MultiArray`` (``[size]``; it has no header, so
its receive time stands in for a stamp). Every topic takes a ``qos`` (``reliability``:
``reliable`` or ``best_effort``; ``durability``: ``volatile`` or ``transient_local``;
``depth``). The default is reliable, volatile, depth 10, so the first messages after
discovery are not lost; a reliable subscription does not match a best-effort publisher,
so set ``reliability: best_effort`` for sensors that publish that way.

Maps shipped with loopgate live in ``robots/maps/`` and are named without ``.yaml``
(``topic_map: reach_arm``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml

from gateway.config import ConfigError, build

JOINT_STATE = "sensor_msgs/JointState"
IMAGE = "sensor_msgs/Image"
WRENCH = "geometry_msgs/WrenchStamped"
POSE = "geometry_msgs/PoseStamped"
FLOAT_ARRAY = "std_msgs/Float64MultiArray"
TRAJECTORY = "trajectory_msgs/JointTrajectory"

SourceType = Literal[
    "sensor_msgs/JointState",
    "sensor_msgs/Image",
    "geometry_msgs/WrenchStamped",
    "geometry_msgs/PoseStamped",
    "std_msgs/Float64MultiArray",
]
JointField = Literal["position", "velocity", "effort"]


@dataclass(frozen=True, kw_only=True)
class Qos:
    """Quality of service of one topic (matched against the robot's own QoS)."""

    reliability: Literal["reliable", "best_effort"] = "reliable"
    """``reliable`` (no lost messages once matched) or ``best_effort`` (sensor streams)."""
    durability: Literal["volatile", "transient_local"] = "volatile"
    """``transient_local`` also delivers the last message sent before this node joined."""
    depth: int = 10
    """Messages kept per topic (keep-last history)."""

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError(f"depth must be >= 1, got {self.depth}")


@dataclass(frozen=True, kw_only=True)
class Source:
    """One observation topic."""

    topic: str
    """Topic name; relative names are resolved under the robot's namespace."""
    type: SourceType
    """Message type, ``package/Message``."""
    fields: dict[str, JointField] = field(default_factory=dict)
    """JointState only: observation key -> ``position``, ``velocity`` or ``effort``."""
    key: str = ""
    """Observation key of the other types' single array."""
    size: int = 0
    """Float64MultiArray only: number of elements."""
    qos: Qos = field(default_factory=Qos)
    """Quality of service of the subscription."""

    def __post_init__(self) -> None:
        if not self.topic:
            raise ValueError("topic must not be empty")
        if self.type == JOINT_STATE:
            if not self.fields or self.key:
                raise ValueError(f"{self.topic}: a JointState source needs 'fields' (key: field), not 'key'")
        elif not self.key or self.fields:
            raise ValueError(f"{self.topic}: a {self.type} source needs 'key', not 'fields'")
        if (self.type == FLOAT_ARRAY) != (self.size > 0):
            raise ValueError(f"{self.topic}: 'size' (> 0) is required for, and only for, {FLOAT_ARRAY}")
        for key in self.keys:
            if not key or "/" in key:
                raise ValueError(f"{self.topic}: observation key {key!r} must be non-empty without '/'")

    @property
    def keys(self) -> tuple[str, ...]:
        """Observation keys this source produces."""
        return tuple(self.fields) if self.type == JOINT_STATE else (self.key,)

    @property
    def stamped(self) -> bool:
        """Whether messages carry a header stamp (else the receive time is used)."""
        return self.type != FLOAT_ARRAY

    def shape(self, num_joints: int, image_shape: tuple[int, int] | None) -> tuple[int, ...]:
        """Shape of one of this source's arrays (images: the task's configured size)."""
        if self.type == JOINT_STATE:
            return (num_joints,)
        if self.type == IMAGE:
            if image_shape is None:
                raise ValueError(f"{self.topic}: an image source needs the task's image size")
            return (*image_shape, 3)
        return {WRENCH: (6,), POSE: (7,)}.get(self.type, (self.size,))


@dataclass(frozen=True, kw_only=True)
class ActionSink:
    """Where joint commands go."""

    topic: str
    """Command topic, e.g. ``forward_position_controller/commands``."""
    type: Literal["std_msgs/Float64MultiArray", "trajectory_msgs/JointTrajectory"] = (
        "std_msgs/Float64MultiArray"
    )
    """Float64MultiArray (ros2_control forward controllers) or JointTrajectory (one point per command)."""
    interface: Literal["position", "velocity"] = "position"
    """What the numbers command; JointTrajectory carries positions only."""
    qos: Qos = field(default_factory=Qos)
    """Quality of service of the publisher."""

    def __post_init__(self) -> None:
        if self.type == TRAJECTORY and self.interface != "position":
            raise ValueError(f"{self.topic}: a JointTrajectory sink commands positions (interface: position)")


@dataclass(frozen=True, kw_only=True)
class Topic:
    """A topic with a fixed message type (e-stop, target marker)."""

    topic: str
    """Topic name."""
    qos: Qos = field(default_factory=Qos)
    """Quality of service."""


@dataclass(frozen=True, kw_only=True)
class TopicMap:
    """A robot's topics; see the module docstring for the YAML form."""

    joints: tuple[str, ...]
    """Joint names in the order of the task's joint vectors."""
    observations: tuple[Source, ...]
    """Observation sources; the first JointState is the robot's heartbeat."""
    action: ActionSink
    """The command sink."""
    estop: Topic | None = None
    """``std_msgs/Bool`` e-stop topic (normally absolute, shared by every robot)."""
    target: Topic | None = None
    """Optional ``geometry_msgs/PoseStamped`` topic the task's target is published on at reset (for displays)."""
    name: str = "inline"
    """Where the map came from (for messages)."""

    def __post_init__(self) -> None:
        if not self.joints or len(set(self.joints)) != len(self.joints):
            raise ValueError(f"joints must be non-empty and unique, got {list(self.joints)}")
        if not any(s.type == JOINT_STATE for s in self.observations):
            raise ValueError("observations need a sensor_msgs/JointState source")
        seen: set[str] = set()
        for source in self.observations:
            dup = seen & set(source.keys)
            if dup:
                raise ValueError(f"observation key(s) {sorted(dup)} come from two sources")
            seen |= set(source.keys)

    @property
    def primary(self) -> Source:
        """The first JointState source: its silence means the robot is gone."""
        return next(s for s in self.observations if s.type == JOINT_STATE)

    def source_of(self, key: str) -> Source | None:
        return next((s for s in self.observations if key in s.keys), None)


def load_topic_map(value: str | Mapping[str, Any], where: str = "env.options.topic_map") -> TopicMap:
    """A :class:`TopicMap` from a shipped map name, a YAML path or an inline mapping.

    Raises :class:`~gateway.config.ConfigError` naming the file and the field.
    """
    if isinstance(value, Mapping):
        data, name = dict(value), "inline"
    else:
        path = _find(value, where)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{where}: {path} is not valid YAML: {exc}") from exc
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: {path} must hold a mapping (joints, observations, action)")
        data, name = dict(data), str(path)
        where = f"{where} ({path})"
    data.setdefault("name", name)
    topic_map: TopicMap = build(TopicMap, data, where)
    return topic_map


def shipped_maps() -> list[str]:
    """Names of the maps in ``robots/maps``."""
    folder = resources.files("robots").joinpath("maps")
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def _find(value: str, where: str) -> Path:
    path = Path(value).expanduser()
    if path.is_file():
        return path
    shipped = resources.files("robots").joinpath("maps").joinpath(f"{value}.yaml")
    if "/" not in value and shipped.is_file():
        return Path(str(shipped))
    raise ConfigError(
        f"{where}: {value!r} is neither a file nor a shipped map (shipped: {', '.join(shipped_maps())})"
    )
