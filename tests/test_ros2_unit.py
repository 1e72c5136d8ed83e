"""The ROS 2 backend's pure parts: topic maps, config and spec, safety limits, stamp alignment.

None of these need rclpy; they run everywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from gateway.config import ConfigError, build, load_config
from gateway.factory import experiment_spec
from robots.ros2_config import Ros2Config
from robots.safety import CommandLimits, EstopLatch, SafetyConfig, Watchdog
from robots.sources import Entry, JointStateConverter, TopicMapMismatch, align, image_array
from robots.topic_map import load_topic_map, shipped_maps

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]


def ros2_options(**options: Any) -> Ros2Config:
    config: Ros2Config = build(Ros2Config, options, "env.options")
    return config


# ------------------------------------------------------------------ sim <-> real


def test_reach_ros2_config_differs_from_reach_sim_only_in_its_env_block() -> None:
    sim = yaml.safe_load((REPO / "configs/reach_sim.yaml").read_text())
    real = yaml.safe_load((REPO / "configs/reach_ros2.yaml").read_text())
    assert sim.pop("env") != real.pop("env")
    differ = sorted(k for k in {*sim, *real} if sim.get(k) != real.get(k))
    assert not differ, (
        f"configs/reach_ros2.yaml is the real twin of configs/reach_sim.yaml: block(s) {differ} differ; "
        "copy every block but env: from reach_sim.yaml"
    )
    load_config(REPO / "configs/reach_ros2.yaml")


def test_ros2_spec_equals_mujoco_spec_for_the_same_task_options() -> None:
    for options in (
        {},
        {"max_episode_steps": 30, "success_radius": 0.03},
        {"camera": True, "image_width": 32},
    ):
        sim = experiment_spec("mujoco_reach", dict(options))
        real = experiment_spec("ros2", dict(options))
        assert sim.mismatches(real) == [] and real.mismatches(sim) == []
        assert dict(real.metadata) == dict(sim.metadata)


def test_extra_observations_from_the_map_join_the_spec() -> None:
    topic_map = {
        "joints": ["joint0", "joint1", "joint2"],
        "observations": [
            {
                "topic": "joint_states",
                "type": "sensor_msgs/JointState",
                "fields": {"joint_pos": "position", "joint_vel": "velocity", "effort": "effort"},
            },
            {"topic": "ft", "type": "geometry_msgs/WrenchStamped", "key": "wrench"},
        ],
        "action": {"topic": "forward_position_controller/commands"},
    }
    spec = ros2_options(topic_map=topic_map, extra_observations=["wrench", "effort"]).spec()
    assert spec.observation["wrench"].shape == (6,) and spec.observation["effort"].shape == (3,)


# ------------------------------------------------------------------- topic maps


def test_shipped_maps_load_and_name_their_topics() -> None:
    assert {"reach_arm", "reach_arm_velocity"} <= set(shipped_maps())
    reach = load_topic_map("reach_arm")
    assert reach.joints == ("joint0", "joint1", "joint2")
    assert reach.primary.topic == "joint_states"
    assert reach.action.topic == "forward_position_controller/commands"
    assert load_topic_map("reach_arm_velocity").action.interface == "velocity"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"observations": []}, "JointState"),
        ({"joints": ["a", "a"]}, "unique"),
        (
            {"action": {"topic": "x", "type": "trajectory_msgs/JointTrajectory", "interface": "velocity"}},
            "positions",
        ),
        ({"observations": [{"topic": "js", "type": "sensor_msgs/JointState", "key": "x"}]}, "fields"),
        (
            {"observations": [{"topic": "js", "type": "sensor_msgs/Joint", "fields": {"a": "position"}}]},
            "type",
        ),
    ],
)
def test_bad_topic_maps_are_refused_naming_the_problem(change: dict[str, Any], message: str) -> None:
    data = yaml.safe_load((REPO / "robots/maps/reach_arm.yaml").read_text())
    data.update(change)
    with pytest.raises(ConfigError, match=message):
        load_topic_map(data)


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"env.options.topic_map.*no_such_map"):
        ros2_options(topic_map="no_such_map")
    with pytest.raises(ConfigError, match=r"env.options.safety.*max_velocity"):
        ros2_options(safety={"max_velocity": 0})
    with pytest.raises(ConfigError, match=r"lost_timeout_s"):
        ros2_options(lost_timeout_s=0.05)
    no_camera = yaml.safe_load((REPO / "robots/maps/reach_arm.yaml").read_text())
    no_camera["observations"] = no_camera["observations"][:1]
    with pytest.raises(ConfigError, match="key: image"):
        ros2_options(topic_map=no_camera, camera=True)


# ----------------------------------------------------------------------- safety


def test_position_commands_are_clamped_to_limits_and_step_size() -> None:
    limits = CommandLimits(
        SafetyConfig(
            position_low=(-0.5, -1, -1), position_high=(0.5, 1, 1), max_step_change=0.1, max_velocity=10
        ),
        (-3, -2.5, -2.5),
        (3, 2.5, 2.5),
        control_hz=20,
    )
    previous = np.array([[0.45, 0.0, 0.0], [0.0, 0.0, 0.0]])
    command, clamped = limits.position([[0.9, 0.05, 0.0], [0.05, -0.05, 0.0]], previous)
    np.testing.assert_allclose(command, [[0.5, 0.05, 0.0], [0.05, -0.05, 0.0]])
    assert clamped.tolist() == [True, False]
    command, clamped = limits.position([[0.0, 0.3, 0.0]], [[0.0, 0.0, 0.0]])
    np.testing.assert_allclose(command, [[0.0, 0.1, 0.0]])
    assert limits.counts.counts == {"position": 1, "step": 1}


def test_velocity_limit_bounds_the_step_and_never_pushes_past_a_limit() -> None:
    limits = CommandLimits(
        SafetyConfig(max_velocity=1.0, max_step_change=1.0), (-1,) * 3, (1,) * 3, control_hz=10
    )
    assert limits.max_change == pytest.approx(0.1)
    velocity, clamped = limits.velocity([[2.0, 0.5, -0.5]], [[0.0, 1.0, 0.0]])
    np.testing.assert_allclose(velocity, [[1.0, 0.0, -0.5]])
    assert clamped.tolist() == [True]


def test_watchdog_trips_once_per_silence_and_rearms() -> None:
    dog = Watchdog(0.5)
    assert not dog.expired(10.0)  # never fed: nothing to watch
    dog.feed(10.0)
    assert not dog.expired(10.4)
    assert dog.expired(10.6) and not dog.expired(11.0)
    assert dog.feed(11.1)  # resumed
    assert dog.expired(11.7) and dog.trips == 2
    dog.pause()
    assert not dog.expired(20.0)


def test_estop_stays_engaged_until_every_source_releases() -> None:
    latch = EstopLatch()
    assert latch.set("topic", True) and latch.engaged
    assert not latch.set("gateway", True)
    assert not latch.set("topic", False) and latch.engaged
    assert latch.set("gateway", False) and not latch.engaged
    assert latch.engagements == 1


# ------------------------------------------------------------ messages, stamps


class _Msg:
    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


def test_joint_states_are_read_by_name_in_the_maps_order() -> None:
    source = load_topic_map("reach_arm").primary
    convert = JointStateConverter(source, ("joint0", "joint1", "joint2"), "test")
    msg = _Msg(
        name=["joint2", "gripper", "joint0", "joint1"],
        position=[3.0, 9.0, 1.0, 2.0],
        velocity=[0.3, 9, 0.1, 0.2],
        effort=[],
    )
    values = convert(msg)
    np.testing.assert_allclose(values["joint_pos"], [1, 2, 3])
    np.testing.assert_allclose(values["joint_vel"], [0.1, 0.2, 0.3])
    with pytest.raises(TopicMapMismatch, match=r"joint9.*not published"):
        JointStateConverter(source, ("joint0", "joint9", "joint2"), "test")(msg)


def test_alignment_picks_the_messages_nearest_the_laggards_newest_stamp() -> None:
    def entries(stamps: list[float]) -> list[Entry]:
        return [Entry(s, s, {"t": s}) for s in stamps]

    fast = entries([i * 0.01 for i in range(100)])  # 100 Hz up to 0.99
    camera = entries([0.1, 0.2, 0.3, 0.4, 0.5])  # lags: newest 0.5
    chosen, spread = align([fast, camera])
    assert chosen[0].stamp == pytest.approx(0.5) and chosen[1].stamp == 0.5
    assert spread == pytest.approx(0.0, abs=1e-9)
    far = entries([5.0, 5.1])  # a clock 4.5 s ahead: nothing near it
    chosen, spread = align([fast, far])
    assert spread == pytest.approx(5.0 - 0.99)


def test_images_are_converted_to_rgb_and_resized() -> None:
    bgr = np.zeros((4, 6, 3), np.uint8)
    bgr[..., 0] = 255  # blue in BGR
    out = image_array((4, 6, "bgr8", 18, bgr.tobytes()), (2, 3), "test")
    assert out.shape == (2, 3, 3) and (out[..., 2] == 255).all() and (out[..., 0] == 0).all()
    with pytest.raises(TopicMapMismatch, match="encoding"):
        image_array((4, 6, "yuv422", 12, bytes(48)), (2, 3), "test")
