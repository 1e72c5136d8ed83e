# ruff: noqa: F811 - pytest fixtures imported from test_ros2_backend are test parameters here
"""ROS 2 robots behind a real gateway: operator commands, the e-stop, a robot that dies.

Real processes throughout: the gateway (``python -m gateway.hub`` or ``loopgate up``),
env workers with the ``ros2`` backend, and emulators as the robots.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gateway.control_client import ControlClient
from tests.conftest import wait_for
from tests.test_ros2_backend import (  # noqa: F401 - fixtures
    WHY_NOT,
    commands,
    domain,
    options,
    robot,
    stop_gracefully,
)
from tests.test_ros2_safety import PERIOD_S, SCHEDULING_SLACK_S

pytestmark = [
    pytest.mark.ros2,
    pytest.mark.integration,
    pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT)),
]


def steps(status: dict[str, Any]) -> int:
    return int(status["env_steps"])


def plateau(read: Any, settle_s: float = 1.0) -> int:
    """The value ``read()`` stops at (it must not change for ``settle_s``)."""

    def still() -> int | None:
        before = read()
        time.sleep(settle_s)
        after = read()
        return after if after == before else None

    return int(wait_for(still, timeout=30, what="progress to stop"))


def test_operator_ready_and_estop_reach_the_robot_through_the_gateway(gateway_run, robot, domain) -> None:
    record = robot("/arm")
    env_options = options(domain, ["/arm"], max_episode_steps=40, reset={"wait_for_operator": True})
    run = gateway_run(
        {"env": {"backend": "ros2", "num_envs": 1, "options": env_options}, "policy": {"kind": "random"}}
    )
    worker = run.worker(0)
    try:
        ready_then_estop(run, record)
    finally:
        stop_gracefully([worker])


def ready_then_estop(run: Any, record: Path) -> None:
    wait_for(lambda: run.status()["workers"], timeout=60, what="the worker to register")
    # Waiting for the operator takes longer than the gateway's worker timeout (3 s):
    # the backend's keepalive keeps the worker registered meanwhile.
    time.sleep(4.0)
    status = run.status()
    assert steps(status) == 0 and len(status["workers"]) == 1 and status["episodes_interrupted"] == 0
    assert run.control.request("ready", timeout_s=5.0) == {"ready": True, "workers": 1}
    wait_for(lambda: steps(run.status()) >= 5, what="steps after ready")

    before = len(commands(record))
    sent = time.time()
    run.control.request("estop", timeout_s=5.0, engaged=True, reason="test")
    held = plateau(lambda: steps(run.status()))
    after = [c for c in commands(record)[before:] if c["t"] > sent]
    assert after, "no hold reached the robot"
    hold = after[-1]["data"]
    np.testing.assert_allclose(hold, after[-1]["qpos"], atol=0.1)
    first = len(after) - 1
    while first > 0 and np.allclose(after[first - 1]["data"], hold):
        first -= 1
    assert after[first]["t"] - sent <= PERIOD_S + SCHEDULING_SLACK_S
    assert held < 40

    run.control.request("estop", timeout_s=5.0, engaged=False)
    # The episode runs to its limit and the next reset waits for the operator again:
    # the 40th step's observation comes once the next episode may start.
    assert plateau(lambda: steps(run.status())) == 39
    run.control.request("ready", timeout_s=5.0)
    wait_for(lambda: steps(run.status()) >= 45, what="the second episode")
    assert run.status()["episodes"] >= 1


@pytest.mark.timeout(420)  # the waits below, each with its own deadline, add up to 400 s
def test_robot_killed_mid_episode_is_interrupted_and_picked_up_when_it_returns(
    procs, robot, domain, tmp_path
) -> None:
    """Robot /a's emulator is killed mid-episode: its episode is interrupted, robot /b in its
    own worker goes on, and /a is picked up again when it returns. Every look at the
    gateway's workers is one snapshot, since a worker starved past the gateway's timeout on
    a loaded machine drops out and rejoins between two requests."""
    robot("/a")
    robot("/b")
    run_dir = tmp_path / "run"
    sets = ["env.options.namespaces=[/a]", "env.options.lost_timeout_s=1.0"]
    up = procs.spawn(
        "-m", "gateway", "up", "configs/reach_ros2.yaml", "--run-dir", str(run_dir),
        *[arg for s in sets for arg in ("--set", s)], name="up",
    )  # fmt: skip
    endpoints = run_dir / "endpoints.json"
    wait_for(endpoints.exists, what="endpoints.json")
    control = ControlClient(json.loads(endpoints.read_text())["gateway"]["control"])
    try:
        # Another robot on the same gateway, in a worker of its own, which nothing here
        # restarts: its robot is given the usual time before it counts as lost (a busy
        # machine can hold an emulator's messages back past /a's one second).
        other = procs.spawn(
            "-m", "gateway.worker", "--config", str(run_dir / "config.yaml"), "--endpoints", str(endpoints),
            "--index", "1", "--option", "namespaces=[/b]", "--option", "lost_timeout_s=10.0",
            name="worker-b",
        )  # fmt: skip

        def by_worker() -> dict[str, int]:
            return {w["uid"]: w["env_steps"] for w in control.request("status", timeout_s=5.0)["workers"]}

        def is_b(uid: str) -> bool:
            return f"-{other.pid}-" in uid

        def steps_of_b() -> int:
            return sum(n for uid, n in by_worker().items() if is_b(uid))

        seen: dict[str, int] = {}

        def both_robots_stepping() -> bool:
            # One snapshot per look: a worker may drop out and rejoin between two requests.
            seen.clear()
            seen.update(by_worker())
            return len(seen) == 2 and min(seen.values()) >= 20

        wait_for(both_robots_stepping, timeout=90, what="both robots")
        first_a = next(uid for uid in seen if not is_b(uid))
        interrupted_before = control.request("status", timeout_s=5.0)["episodes_interrupted"]
        emulator_a = procs.procs[0]
        os.killpg(emulator_a.pid, signal.SIGKILL)  # mid-episode: 50-step episodes, ~20 steps in
        wait_for(
            lambda: control.request("status", timeout_s=5.0)["episodes_interrupted"] > interrupted_before,
            timeout=30,
            what="the interruption",
        )
        wait_for(lambda: first_a not in by_worker(), timeout=30, what="robot /a's worker to leave")
        b_then = steps_of_b()
        wait_for(lambda: steps_of_b() >= b_then + 20, what="the other robot to go on")

        robot("/a")  # the robot comes back; the restarted worker picks it up
        wait_for(
            lambda: any(uid != first_a and not is_b(uid) and n >= 20 for uid, n in by_worker().items()),
            timeout=90,
            what="robot /a stepping again",
        )
    finally:
        control.close()
        stop_gracefully([p for p in procs.procs if Path(p.log_path).name.startswith("worker-b")])  # type: ignore[attr-defined]
        up.send_signal(signal.SIGINT)
        up.wait(timeout=60)
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    assert summary["interrupted_episodes"] >= 1
    assert summary["stored_steps"] == summary["acked_steps"] > 0
    assert summary["lost_steps"] == 0 and summary["duplicate_steps"] == 0
    assert "RobotDisconnected" in (run_dir / "logs" / "worker-0.log").read_text()


def test_up_prints_why_a_worker_exited(domain, tmp_path) -> None:
    """No robot answers in the namespace: the worker's RobotUnavailable reaches the console."""
    from tests.conftest import loopgate

    sets = [
        "env.options.namespaces=[/nobody_here]",
        "env.options.connect_timeout_s=1.0",
        "run.max_restarts=1",
        "policy.kind=random",
        "trainer.enabled=false",
        "inference.enabled=false",
        "replay.enabled=false",
    ]
    out = loopgate(
        "up", "configs/reach_ros2.yaml", "--run-dir", str(tmp_path / "run"),
        *[arg for s in sets for arg in ("--set", s)], timeout=180,
    )  # fmt: skip
    assert out.returncode == 1
    restart = next(line for line in out.stderr.splitlines() if "restart 1/1" in line)
    assert "RobotUnavailable" in restart and "/nobody_here" in restart, restart


@pytest.mark.timeout(120)
def test_up_says_what_a_worker_that_has_not_registered_waits_for(domain, tmp_path) -> None:
    """A robot that does not publish: the worker waits for it (up to ``connect_timeout_s``,
    60 s) before it registers. ``loopgate up``'s own output says so within seconds
    (``run.start_notice_s``, 2 s here, 10 by default), with the worker's last log line
    (what it waits for), instead of only ``env_steps=0``."""
    import subprocess
    import sys

    from tests.conftest import REPO

    sets = [
        "env.options.namespaces=[/nobody_here]",
        "policy.kind=random",
        "trainer.enabled=false",
        "inference.enabled=false",
        "replay.enabled=false",
        "run.start_notice_s=2",
    ]
    out = tmp_path / "up.log"
    with open(out, "wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "up", "configs/reach_ros2.yaml", "--run-dir", str(tmp_path / "run"),
             *[arg for s in sets for arg in ("--set", s)]],
            cwd=REPO, stdout=sink, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        # Told every 2 s; the worker says what it waits for every 5 s.
        notice = wait_for(
            lambda: next(
                (
                    ln
                    for ln in out.read_text().splitlines()
                    if "has not registered" in ln and "waiting for" in ln
                ),
                None,
            ),
            timeout=60,
            what="loopgate up to say what worker-0, not registered, waits for",
        )
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "worker-0 has not registered with the gateway" in notice, notice
    assert "waiting for the robot: nothing yet on ['/nobody_here/joint_states']" in notice, notice
    assert proc.returncode == 130, out.read_text()[-3000:]
