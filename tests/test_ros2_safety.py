# ruff: noqa: F811 - pytest fixtures imported from test_ros2_backend are test parameters here
"""Safety on a ROS 2 robot, checked from the robot's side (the emulator's command record).

Clamps, the action watchdog and the e-stop act in the backend whatever the policy sends;
the emulator records every command it receives with its arrival time, so each test
asserts on what actually reached the robot.
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest

from gateway.config import ConfigError
from robots.sources import TopicMapMismatch
from robots.testing import read_record
from tests.conftest import REPO, wait_for
from tests.test_ros2_backend import (  # noqa: F401 - fixtures
    WHY_NOT,
    backends,
    commands,
    domain,
    options,
    robot,
    steps_run,
)

pytestmark = [
    pytest.mark.ros2,
    pytest.mark.integration,
    pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT)),
]

PERIOD_S = 0.05
"""The control period at the task's 20 Hz."""
SCHEDULING_SLACK_S = 0.25
"""Added to "within one control period": the hold is published from the backend's
safety executor thread the moment the e-stop message arrives (a few ms on an idle
machine), but a loaded 2-core CI machine can keep any thread off a core for a while.
The bound proves the stop does not wait for the control loop (which would take a
period per step plus the policy) without asserting on the machine's speed."""


def test_actions_beyond_limits_are_clamped_before_they_reach_the_topic(robot, backends, domain) -> None:
    record = robot("/arm")
    low, high = np.array([-0.4, 0.3, 0.3]), np.array([0.4, 0.9, 0.9])
    safety = {"position_low": low.tolist(), "position_high": high.tolist(), "max_step_change": 0.05}
    backend = backends(1, init_noise=0.0, **options(domain, ["/arm"], safety=safety))
    backend.reset(seed=0)
    clamped = []
    for action in [[5.0, 1.0, -1.0]] * 12 + [[-1.0, -7.0, 1.0]] * 14:
        clamped.append(backend.step(np.array([action], np.float32))[4]["clamped"][0])
    assert all(clamped)
    sent = np.array(
        [c["data"] for c in wait_for(lambda: commands(record) if len(commands(record)) >= 26 else None)]
    )
    assert np.all(sent >= low - 1e-9) and np.all(sent <= high + 1e-9), "a command beyond the position limits"
    assert np.abs(np.diff(sent, axis=0)).max() <= 0.05 + 1e-9, "a command changed more than max_step_change"
    assert sent[:, 0].max() == pytest.approx(0.4) and sent[:, 1].min() == pytest.approx(0.3)
    counts = backend.counters()["clamps"]  # type: ignore[attr-defined]
    assert counts["action"] == 26 and counts["step"] > 0 and counts["position"] > 0


def test_watchdog_holds_the_robot_when_the_policy_stops(robot, backends, domain) -> None:
    record = robot("/arm")
    backend = backends(1, **options(domain, ["/arm"], safety={"watchdog_timeout_s": 0.3}))
    backend.reset(seed=0)
    push = np.array([[1.0, 1.0, -1.0]], np.float32)
    for _ in range(4):
        backend.step(push)

    def trips() -> int:
        return int(backend.counters()["watchdog_trips"])  # type: ignore[attr-defined]

    wait_for(lambda: trips() == 1, what="the watchdog to trip")  # the policy stopped
    time.sleep(0.6)
    assert trips() == 1  # one trip per silence, however long

    def after_the_steps() -> list[dict[str, Any]] | None:
        sent = commands(record)
        run = steps_run(sent, 0.15 * push[0], 4)  # the reset's last command, then four steps
        if run is None:
            return None
        end = next(i for i in range(len(sent)) if sent[i]["data"] == run[-1]) + 1
        return sent[end:] or None

    held = wait_for(after_the_steps, what="a hold after the last step")
    assert len(held) == 1, "one hold per silence"
    hold = np.array(held[0]["data"])
    # A hold commands where the arm is, not where the last action was taking it.
    np.testing.assert_allclose(hold, held[0]["qpos"], atol=0.05)
    backend.step(np.zeros((1, 3), np.float32))  # actions resume; the watchdog re-arms
    wait_for(lambda: trips() == 2, what="the re-armed watchdog to trip")


def _publish_estop(domain_id: int, engaged: bool) -> float:
    """Publish the e-stop from a node of its own (as an operator's button would); when it left."""
    from std_msgs.msg import Bool

    from robots.ros_io import RosSession

    session = RosSession("estop_button", domain_id=domain_id)
    try:
        node = session.node("estop_button")
        publisher = node.create_publisher(Bool, "/estop", 10)
        wait_for(
            lambda: publisher.get_subscription_count() >= 3, what="e-stop subscribers"
        )  # 2 arms + backend
        sent = time.time()
        publisher.publish(Bool(data=engaged))
        time.sleep(0.3)  # reliable delivery before the node goes
    finally:
        session.close()
    return sent


def test_estop_topic_halts_every_robot_within_one_control_period(robot, backends, domain) -> None:
    records = [robot("/a"), robot("/b")]
    backend = backends(2, **options(domain, ["/a", "/b"]))
    backend.reset(seed=0)
    push = np.array([[1.0, -1.0, 1.0], [-1.0, 1.0, -1.0]], np.float32)
    backend.step(push)
    t_stop = _publish_estop(domain, True)
    infos = [backend.step(push)[4] for _ in range(8)]  # the policy keeps pushing
    assert all(info["estopped"].all() for info in infos)
    for record in records:
        entries = read_record(record)
        assert any(e["topic"] == "estop" and e["data"] for e in entries)
        # Arrival times on the robot's side, against the moment the e-stop was sent.
        after = [e for e in entries if e["topic"] == "command" and e["t"] > t_stop]
        assert after, "no hold reached the robot"
        hold = after[-1]["data"]
        # Where the arm is, not where the policy was pushing it.
        np.testing.assert_allclose(hold, after[-1]["qpos"], atol=0.1)
        # The first of the trailing run of identical commands: from then on, nothing moved.
        first = len(after) - 1
        while first > 0 and np.allclose(after[first - 1]["data"], hold):
            first -= 1
        assert after[first]["t"] - t_stop <= PERIOD_S + SCHEDULING_SLACK_S
    _publish_estop(domain, False)
    before = len(commands(records[0]))
    assert not backend.step(push)[4]["estopped"].any()
    wait_for(lambda: len(commands(records[0])) > before, what="commands after the release")
    assert backend.counters()["estops"] == 1  # type: ignore[attr-defined]


def test_topic_map_naming_a_missing_joint_fails_at_start_up(robot, backends, domain, tmp_path) -> None:
    robot("/arm")
    topic_map = {
        "joints": ["joint0", "joint9", "joint2"],
        "observations": [
            {
                "topic": "joint_states",
                "type": "sensor_msgs/JointState",
                "fields": {"joint_pos": "position", "joint_vel": "velocity"},
            }
        ],
        "action": {"topic": "forward_position_controller/commands"},
    }
    # A connect timeout far beyond the test's own: the error comes with the first joint state.
    with pytest.raises(TopicMapMismatch, match=r"joint9.*not published on /arm/joint_states.*joint0"):
        backends(1, topic_map=topic_map, **options(domain, ["/arm"], connect_timeout_s=3600.0))
    # The worker process refuses to start with the same message and the config-error status.
    (tmp_path / "map.yaml").write_text(__import__("yaml").safe_dump(topic_map))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway.worker",
            "--connect",
            "tcp://127.0.0.1:9",
            "--backend",
            "ros2",
            "--option",
            f"topic_map={tmp_path / 'map.yaml'}",
            "--option",
            "namespaces=[/arm]",
            "--option",
            "connect_timeout_s=30",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "joint9" in out.stderr, out.stderr[-2000:]


def test_a_namespace_count_other_than_num_envs_is_a_config_error(domain) -> None:
    from gateway.factory import make_backend

    with pytest.raises(ValueError, match="namespaces"):
        make_backend("ros2", num_envs=2, options={"namespaces": ["/a"], "domain_id": domain})
    with pytest.raises(ConfigError, match="namespaces"):
        make_backend("ros2", num_envs=1, options={"namespaces": []})
