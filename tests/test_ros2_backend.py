"""The ``ros2`` backend against the robot emulator: real rclpy nodes in separate processes.

The backend runs in the test process with its own rclpy Context (fresh per backend);
each emulator is its own process. Every test leases its own ROS domain
(:class:`robots.testing.DomainLease`) and limits discovery to this host, so parallel runs
never see each other. Safety is checked from the robot's side: emulators started with
``--record`` log every command and e-stop message they receive, with arrival times.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gateway.episode import EpisodeBackend
from gateway.factory import make_backend
from robots.testing import DomainLease, emulator_argv, read_record, ros2_available, ros_env
from tests.conformance.episode_backend import EpisodeBackendConformance
from tests.conftest import Procs, wait_for

WHY_NOT = ros2_available()
if WHY_NOT and os.environ.get("CI"):
    raise RuntimeError(f"CI must run the ROS 2 tests: {WHY_NOT}")
pytestmark = [
    pytest.mark.ros2,
    pytest.mark.integration,
    pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT)),
]

FAST: dict[str, Any] = {
    "connect_timeout_s": 30.0,
    "reset": {"speed": 3.0, "settle_tolerance": 0.05, "settle_velocity": 0.3, "settle_timeout_s": 5.0},
    "safety": {"max_velocity": 6.0, "watchdog_timeout_s": 2.0},
}
"""Options that keep resets short; the task options stay the sim's."""


def options(domain: int, namespaces: list[str], **extra: Any) -> dict[str, Any]:
    merged = {**FAST, "domain_id": domain, "namespaces": namespaces}
    for key, value in extra.items():
        merged[key] = {**merged[key], **value} if isinstance(value, dict) and key in merged else value
    return merged


@pytest.fixture
def domain(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """A ROS domain of this test's own, in this process's environment and its children's."""
    with DomainLease() as lease:
        for key, value in ros_env(lease.id).items():
            monkeypatch.setenv(key, value)
        yield lease.id


def stop_gracefully(processes: list[subprocess.Popen[bytes]], timeout_s: float = 10.0) -> None:
    """SIGTERM, so DDS participants remove their shared-memory segments (SIGKILL leaves them behind)."""
    for proc in processes:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout_s)


@pytest.fixture
def robot(procs: Procs, domain: int, tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """Starts an emulator in namespace ``ns``; returns the path of its command record."""
    started: list[subprocess.Popen[bytes]] = []

    def start(ns: str, *args: str) -> Path:
        record = tmp_path / f"record-{ns.strip('/') or 'root'}.jsonl"
        argv = emulator_argv(*args, namespace=ns, record=record)[1:]
        started.append(procs.spawn(*argv, name=f"emulator{ns.replace('/', '-')}"))
        return record

    try:
        yield start
    finally:
        stop_gracefully(started)


@pytest.fixture
def backends() -> Iterator[Callable[..., EpisodeBackend]]:
    opened: list[EpisodeBackend] = []

    def build(num_envs: int, seed: int = 0, **opts: Any) -> EpisodeBackend:
        backend: EpisodeBackend = make_backend("ros2", num_envs=num_envs, seed=seed, options=opts)
        opened.append(backend)
        return backend

    try:
        yield build
    finally:
        for backend in opened:
            backend.close()


def commands(record: Path) -> list[dict[str, Any]]:
    return [e for e in read_record(record) if e["topic"] == "command"]


# --------------------------------------------------------------------- conformance


@pytest.fixture(scope="class")
def conformance_robots(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Two emulators for the whole class (each test still builds fresh backends)."""
    mp = pytest.MonkeyPatch()
    procs = Procs(tmp_path_factory.mktemp("conformance"))
    with DomainLease() as lease:
        try:
            for key, value in ros_env(lease.id).items():
                mp.setenv(key, value)
            for ns in ("/c0", "/c1"):
                procs.spawn(*emulator_argv(namespace=ns)[1:], name="emulator")
            request.cls.domain = lease.id
            yield
        finally:
            stop_gracefully(procs.procs)
            procs.kill_all()
            mp.undo()


@pytest.mark.usefixtures("conformance_robots")
class TestRos2Conformance(EpisodeBackendConformance):
    num_envs = 2
    deterministic = False
    domain = 0

    def make_backend(
        self, num_envs: int, seed: int, *, max_episode_steps: int | None = None
    ) -> EpisodeBackend:
        opts = options(self.domain, ["/c0", "/c1"][:num_envs], control_hz=50.0)
        if max_episode_steps is not None:
            opts["max_episode_steps"] = max_episode_steps
        backend: EpisodeBackend = make_backend("ros2", num_envs=num_envs, seed=seed, options=opts)
        return backend


# ------------------------------------------------------------------- round trips

INLINE_TRAJECTORY_MAP = {
    "joints": ["joint0", "joint1", "joint2"],
    "observations": [
        {
            "topic": "joint_states",
            "type": "sensor_msgs/JointState",
            "fields": {"joint_pos": "position", "joint_vel": "velocity"},
        }
    ],
    "action": {
        "topic": "joint_trajectory_controller/joint_trajectory",
        "type": "trajectory_msgs/JointTrajectory",
    },
}


@pytest.mark.parametrize(
    ("interface", "topic_map"),
    [("position", "reach_arm"), ("velocity", "reach_arm_velocity"), ("trajectory", INLINE_TRAJECTORY_MAP)],
)
def test_observations_and_actions_round_trip_through_the_emulator(
    robot, backends, domain, interface, topic_map
) -> None:
    record = robot("/arm", "--interface", interface)
    backend = backends(1, topic_map=topic_map, **options(domain, ["/arm"]))
    obs, _ = backend.reset(seed=0)
    start = obs["joint_pos"][0].copy()
    before = len(commands(record))
    action = np.array([[1.0, -1.0, 0.5]], dtype=np.float32)
    for _ in range(6):
        obs, reward, *_ = backend.step(action)
    moved = obs["joint_pos"][0] - start
    assert np.all(np.sign(moved) == np.sign(action[0])) and np.all(np.abs(moved) > 0.1), moved
    np.testing.assert_allclose(reward, -np.hypot(*obs["target_rel"][0]), rtol=1e-5)
    if interface == "velocity":  # speeds toward the moving targets, within the limit
        sent = wait_for(lambda: commands(record)[before:] if len(commands(record)) >= before + 6 else None)
        speeds = np.array([c["data"] for c in sent if any(c["data"])])
        assert np.all(np.sign(speeds.mean(axis=0)) == np.sign(action[0])) and np.abs(speeds).max() <= 6.0
    else:  # absolute targets: the reset's last command plus max_delta * action, six times
        delta = 0.15 * action[0]
        run = wait_for(lambda: steps_run(commands(record), delta, 6), what="six step commands")
        np.testing.assert_allclose(
            np.array(run[1]) - start, delta, atol=0.06
        )  # the arm settled near its target


def test_robot_clocked_steps_each_read_a_state_that_arrived_after_the_last_one(
    robot, backends, domain
) -> None:
    """``clock: robot``: a step waits for the joint state due next, which the stepping
    thread receives itself (the node is borrowed from its executor thread meanwhile)."""
    robot("/arm")  # 100 Hz joint states
    backend = backends(
        1, **options(domain, ["/arm"], clock="robot", control_hz=50.0, max_age_s=2.0, lost_timeout_s=10.0)
    )
    obs, _ = backend.reset(seed=0)
    action = np.array([[1.0, -1.0, 0.5]], dtype=np.float32)
    seen = [obs["joint_pos"][0].copy()]
    for _ in range(15):
        obs, *_ = backend.step(action)
        seen.append(obs["joint_pos"][0].copy())
    moves = np.abs(np.diff(np.array(seen), axis=0)).max(axis=1)
    assert (moves > 0).all(), moves  # never the same state twice: each step waited for a new one
    assert backend.counters()["steps"] == 15


def steps_run(sent: list[dict[str, Any]], delta: np.ndarray, n: int) -> list[list[float]] | None:
    """``n + 1`` consecutive commands, each ``delta`` from the one before (None if not there yet)."""
    data = np.array([c["data"] for c in sent])
    if len(data) <= n:
        return None
    ok = np.all(np.abs(np.diff(data, axis=0) - delta) < 1e-6, axis=1)
    for i in range(len(ok) - n + 1):
        if ok[i : i + n].all():
            return data[i : i + n + 1].tolist()
    return None


def test_reach_pd_succeeds_on_the_emulator_as_in_the_simulator(robot, backends, domain) -> None:
    from gateway.policies import make_policy

    robot("/a")
    robot("/b")
    backend = backends(2, seed=3, **options(domain, ["/a", "/b"]))
    policy = make_policy("reach_pd", backend.spec)
    obs, _ = backend.reset(seed=3)
    outcomes: list[bool] = []
    while len(outcomes) < 6:
        obs, _, terminated, truncated, info = backend.step(policy.act(obs))
        outcomes.extend(info["success"][terminated | truncated].tolist())
    # The simulator reaches >= 95 % (tests/test_sim_mujoco.py); the emulated robot adds
    # real-time physics, message latency and homing, and still reaches nearly always.
    assert np.mean(outcomes) >= 0.8, outcomes


# --------------------------------------------------------------- stamps and age


def test_stamps_are_aligned_across_topics_from_a_skewed_clock(robot, backends, domain) -> None:
    camera = ("--camera", "--camera-rate", "20", "--image-width", "32", "--image-height", "24")
    robot("/near", *camera, "--camera-skew-s", "0.15")  # camera clock 150 ms ahead of the arm's
    # 10 s ahead: beyond what 64 images of history (3.2 s at 20 Hz) can pair with.
    robot("/far", *camera, "--camera-skew-s", "10.0")
    backend = backends(
        2,
        camera=True,
        image_width=32,
        image_height=24,
        max_skew_s=0.03,
        max_age_s=0.5,
        **options(domain, ["/near", "/far"]),
    )
    obs, _ = backend.reset(seed=0)
    assert obs["image"].shape == (2, 24, 32, 3) and obs["image"].any()
    flags = []
    for _ in range(10):
        _, _, _, _, info = backend.step(np.zeros((2, 3), np.float32))
        flags.append(info["misaligned"].copy())
        # /near: the newest image is stamped 150 ms after the newest joint state, yet the
        # pair chosen by stamp is at most half a camera period (25 ms) apart.
        assert info["skew_s"][0] <= 0.03 and info["skew_s"][1] > 5.0
    assert np.all(np.array(flags) == [False, True])
    assert backend.counters()["misaligned"] >= 10  # type: ignore[attr-defined]


def test_stale_observations_are_flagged_while_the_robot_is_paused(robot, procs, backends, domain) -> None:
    robot("/arm")
    backend = backends(1, max_age_s=0.2, lost_timeout_s=5.0, **options(domain, ["/arm"]))
    backend.reset(seed=0)
    zero = np.zeros((1, 3), np.float32)
    assert not backend.step(zero)[4]["stale"][0]
    emulator = procs.procs[-1]
    os.kill(emulator.pid, signal.SIGSTOP)
    try:
        stale = [backend.step(zero)[4] for _ in range(12)]  # 0.6 s without a joint state
    finally:
        os.kill(emulator.pid, signal.SIGCONT)
    assert stale[-1]["stale"][0] and stale[-1]["obs_age_s"][0] > 0.2
    wait_for(lambda: not backend.step(zero)[4]["stale"][0], what="fresh observations after SIGCONT")
    assert backend.counters()["stale"] >= 4  # type: ignore[attr-defined]
