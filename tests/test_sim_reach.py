"""The reach task's numpy core and the ``reach_pd`` policy, without any simulator."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from gateway.config import ConfigError
from gateway.episode import ActionSpec, ArraySpec, EnvSpec
from gateway.policies import make_policy
from sim_bridges.reach import OBS_KEYS, ReachPDConfig, ReachPDPolicy, ReachTask

pytestmark = pytest.mark.unit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_reach_module_does_not_import_mujoco() -> None:
    code = "import sys, sim_bridges.reach; assert 'mujoco' not in sys.modules, 'mujoco was imported'"
    env = {**os.environ, "PYTHONPATH": REPO}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_forward_kinematics_of_known_postures() -> None:
    task = ReachTask()
    np.testing.assert_allclose(task.ee_pos([0.0, 0.0, 0.0]), [0.30, 0.0], atol=1e-12)
    np.testing.assert_allclose(task.ee_pos([np.pi / 2, 0.0, 0.0]), [0.0, 0.30], atol=1e-12)
    np.testing.assert_allclose(task.ee_pos([0.0, np.pi / 2, -np.pi / 2]), [0.20, 0.10], atol=1e-12)
    batch = np.zeros((4, 5, 3))
    assert task.ee_pos(batch).shape == (4, 5, 2)


def test_jacobian_matches_finite_differences() -> None:
    task = ReachTask()
    q = np.random.default_rng(0).uniform(-2, 2, size=(8, 3))
    eps = 1e-6
    numeric = np.stack(
        [
            (task.ee_pos(q + eps * np.eye(3)[j]) - task.ee_pos(q - eps * np.eye(3)[j])) / (2 * eps)
            for j in range(3)
        ],
        axis=-1,
    )
    np.testing.assert_allclose(task.jacobian(q), numeric, atol=1e-8)


def test_initial_states_stay_inside_the_limits_and_the_target_region() -> None:
    task = ReachTask()
    rng = np.random.default_rng(0)
    starts, targets = zip(*(task.sample_initial(rng) for _ in range(2000)))
    q, target = np.array(starts), np.array(targets)
    assert np.all(q >= task.joint_low) and np.all(q <= task.joint_high)
    assert np.all(np.abs(q - task.home_joint_pos) <= task.init_noise + 1e-12)
    radius, angle = np.hypot(*target.T), np.arctan2(target[:, 1], target[:, 0])
    assert radius.min() >= task.target_min_radius and radius.max() <= task.target_max_radius
    assert np.abs(angle).max() <= task.target_max_angle
    # Uniform over the annulus's area: the median squared radius sits halfway.
    mid = (task.target_min_radius**2 + task.target_max_radius**2) / 2
    assert np.median(radius**2) == pytest.approx(mid, rel=0.05)


def test_same_generator_seed_gives_the_same_episode_start() -> None:
    task = ReachTask()
    a = task.sample_initial(np.random.default_rng(7))
    b = task.sample_initial(np.random.default_rng(7))
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_actions_move_position_targets_by_max_delta_within_limits() -> None:
    task = ReachTask(max_delta=0.2)
    ctrl = np.array([[0.0, 2.4, -2.45]])
    out = task.apply_action(ctrl, np.array([[0.5, 1.0, -3.0]], np.float32))
    np.testing.assert_allclose(out, [[0.1, 2.5, -2.5]])


def test_observation_layout_reward_and_success() -> None:
    task = ReachTask()
    q, qd, target = np.zeros((2, 3)), np.ones((2, 3)), np.array([[0.30, 0.04], [0.0, 0.2]])
    obs = task.observe(q, qd, target)
    assert tuple(obs) == OBS_KEYS
    assert all(v.dtype == np.float32 for v in obs.values())
    np.testing.assert_allclose(obs["target_rel"], target - task.ee_pos(q), atol=1e-7)
    np.testing.assert_allclose(task.reward(obs["ee_pos"], target), [-0.04, -np.hypot(0.3, 0.2)], atol=1e-6)
    np.testing.assert_array_equal(task.success(obs["ee_pos"], target), [True, False])
    reward, success, terminated, distance = task.outcome(obs)
    np.testing.assert_allclose(reward, -distance)
    np.testing.assert_array_equal(success, [True, False])
    assert not terminated.any()
    _, _, terminated, _ = ReachTask(terminate_on_success=True).outcome(obs)
    np.testing.assert_array_equal(terminated, [True, False])


def test_spec_describes_the_layout_and_carries_the_task() -> None:
    task = ReachTask(success_radius=0.03, max_delta=0.1)
    spec = task.spec(max_episode_steps=40, image_shape=(24, 32))
    assert spec.name == "reach" and spec.control_hz == 20.0 and spec.max_episode_steps == 40
    assert spec.observation["image"] == ArraySpec(dtype="uint8", shape=(24, 32, 3))
    assert spec.observation["joint_pos"] == ArraySpec(dtype="float32", shape=(3,))
    assert spec.action == ActionSpec(dtype="float32", shape=(3,), low=(-1.0,) * 3, high=(1.0,) * 3)
    assert ReachTask.from_metadata(EnvSpec.from_dict(spec.to_dict()).metadata) == task


@pytest.mark.parametrize(("field", "value"), [("link_lengths", (0.1, 0.0, 0.1)), ("target_max_radius", 0.5)])
def test_impossible_task_is_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        ReachTask(**{field: value})  # type: ignore[arg-type]


def test_pd_policy_reaches_targets_on_an_ideal_arm() -> None:
    """Kinematics only (the arm follows its targets exactly): a check of the control law itself."""
    task = ReachTask()
    policy = ReachPDPolicy(task.spec())
    rng = np.random.default_rng(0)
    starts, targets = zip(*(task.sample_initial(rng) for _ in range(200)))
    q, target = np.array(starts), np.array(targets)
    for _ in range(40):
        action = policy.act(task.observe(q, np.zeros_like(q), target))
        assert action.dtype == np.float32 and np.abs(action).max() <= 1.0
        q = task.apply_action(q, action)
    assert task.success(task.ee_pos(q), target).mean() >= 0.99


def test_pd_policy_is_damped_least_squares_with_a_null_space_pull() -> None:
    """The policy's hand-written 2x2 algebra against the textbook form (:func:`_reference`,
    numpy's batched inverse on the task's Jacobian): random postures, the straight arm the
    damping exists for among them, velocities and targets, one env to many."""
    task = ReachTask()
    cfg = ReachPDConfig(gain=0.7, lookahead_s=0.1, damping=0.05, null_gain=0.2)
    policy = ReachPDPolicy(task.spec(), cfg)
    rng = np.random.default_rng(3)
    for n in (1, 2, 8, 100):
        q = rng.uniform(-3.0, 3.0, (n, 3))
        q[0] = 0.0
        qd, target = rng.uniform(-2.0, 2.0, (n, 3)), rng.uniform(-0.3, 0.3, (n, 2))
        obs = task.observe(q, qd, target)
        got = policy.act(obs)
        assert got.dtype == np.float32 and got.shape == (n, 3)
        # The reference starts from the observation's float32 values, as the policy does.
        q32, qd32, t32 = (np.asarray(obs[k], np.float64) for k in ("joint_pos", "joint_vel", "target_pos"))
        np.testing.assert_allclose(got, _reference(task, cfg, q32, qd32, t32), rtol=1e-5, atol=1e-6)


def _reference(
    task: ReachTask, cfg: ReachPDConfig, q: np.ndarray, qd: np.ndarray, target: np.ndarray
) -> np.ndarray:
    """``reach_pd``'s action as the textbook writes it, with matrices."""
    jac = task.jacobian(q)
    jt = np.swapaxes(jac, -1, -2)
    ee = task.ee_pos(q) + cfg.lookahead_s * (jac @ qd[..., None])[..., 0]
    pinv = jt @ np.linalg.inv(jac @ jt + cfg.damping**2 * np.eye(2))
    dq = (pinv @ (cfg.gain * (target - ee))[..., None])[..., 0]
    null = np.eye(3) - pinv @ jac
    dq += cfg.null_gain * (null @ (np.asarray(task.home_joint_pos) - q)[..., None])[..., 0]
    action = dq / task.max_delta
    return (action / np.maximum(1.0, np.abs(action).max(axis=-1, keepdims=True))).astype(np.float32)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"gain": 0.0}, "policy.options.gain"),
        ({"damping": -1.0}, "policy.options.damping"),
        ({"gian": 1}, "gian"),
    ],
)
def test_bad_policy_option_names_the_field(options: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        make_policy("reach_pd", ReachTask().spec(), options)


def test_pd_config_validates_directly() -> None:
    with pytest.raises(ValueError, match=r"policy.options.null_gain"):
        ReachPDConfig(null_gain=2.0)


def test_pd_policy_refuses_another_task() -> None:
    spec = EnvSpec(
        name="cartpole",
        observation={"obs": ArraySpec(dtype="float32", shape=(4,))},
        action=ActionSpec(dtype="int64", shape=(), low=(0.0,), high=(1.0,)),
        control_hz=50,
        max_episode_steps=500,
    )
    with pytest.raises(ValueError, match="reach"):
        make_policy("reach_pd", spec)
