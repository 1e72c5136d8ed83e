"""The ``mujoco_reach`` backend and ``loopgate/Reach-v0``: conformance, task quality, rendering."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import warnings
from typing import Any

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import sim_bridges.mujoco as reach_mujoco
from gateway.config import ConfigError
from gateway.episode import EpisodeBackend
from gateway.factory import make_backend
from gateway.policies import make_policy
from sim_bridges.reach import ReachTask
from sim_bridges.rendering import import_mujoco
from tests.conformance.episode_backend import EpisodeBackendConformance

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def reach_backend(num_envs: int, seed: int = 0, **options: Any) -> EpisodeBackend:
    backend: EpisodeBackend = make_backend("mujoco_reach", num_envs=num_envs, seed=seed, options=options)
    return backend


class TestMujocoReachConformance(EpisodeBackendConformance):
    num_envs = 3

    def make_backend(
        self, num_envs: int, seed: int, *, max_episode_steps: int | None = None
    ) -> EpisodeBackend:
        options = {} if max_episode_steps is None else {"max_episode_steps": max_episode_steps}
        return reach_backend(num_envs, seed, **options)


class TestMujocoReachCameraConformance(EpisodeBackendConformance):
    def make_backend(
        self, num_envs: int, seed: int, *, max_episode_steps: int | None = None
    ) -> EpisodeBackend:
        # Not square, so a swapped width and height shows.
        options: dict[str, Any] = {"camera": True, "image_width": 32, "image_height": 24}
        if max_episode_steps is not None:
            options["max_episode_steps"] = max_episode_steps
        return reach_backend(num_envs, seed, **options)


def run_episodes(backend: EpisodeBackend, policy_kind: str, episodes: int, seed: int = 0) -> float:
    """Fraction of episodes whose last step is a success."""
    policy = make_policy(policy_kind, backend.spec, seed=seed)
    obs, _ = backend.reset(seed=seed)
    outcomes: list[bool] = []
    while len(outcomes) < episodes:
        obs, _, terminated, truncated, info = backend.step(policy.act(obs))
        outcomes.extend(info["success"][terminated | truncated].tolist())
    return float(np.mean(outcomes[:episodes]))


@pytest.mark.unit
def test_reach_pd_policy_succeeds_in_at_least_95_percent_of_episodes() -> None:
    with reach_backend(8, seed=0) as backend:
        assert run_episodes(backend, "reach_pd", episodes=40, seed=1) >= 0.95


@pytest.mark.unit
def test_random_policy_rarely_succeeds() -> None:
    with reach_backend(8, seed=0) as backend:
        assert run_episodes(backend, "random", episodes=40, seed=1) <= 0.25


@pytest.mark.unit
def test_reaching_does_not_end_an_episode_by_default() -> None:
    with reach_backend(4, seed=0, max_episode_steps=30) as backend:
        policy = make_policy("reach_pd", backend.spec)
        obs, _ = backend.reset(seed=0)
        successes = 0
        for _ in range(29):
            obs, _, terminated, truncated, info = backend.step(policy.act(obs))
            successes += int(info["success"].sum())
            assert not terminated.any() and not truncated.any()
        assert successes > 0


@pytest.mark.unit
def test_terminate_on_success_ends_the_episode_on_arrival() -> None:
    with reach_backend(4, seed=0, terminate_on_success=True) as backend:
        policy = make_policy("reach_pd", backend.spec)
        obs, _ = backend.reset(seed=0)
        for _ in range(50):
            obs, _, terminated, _, info = backend.step(policy.act(obs))
            np.testing.assert_array_equal(terminated, info["success"])
            if terminated.any():
                final = info["final_obs"]["target_rel"][terminated]
                assert np.all(np.hypot(final[:, 0], final[:, 1]) < 0.05)
                return
        pytest.fail("no episode terminated on success")


@pytest.mark.unit
def test_task_kinematics_match_the_mujoco_fingertip_site() -> None:
    task = ReachTask()
    mujoco = import_mujoco(rendering=False)
    model = reach_mujoco.load_model(mujoco, task, 0.01)
    data = mujoco.MjData(model)
    site = model.site(reach_mujoco.FINGERTIP_SITE).id
    jac_pos, jac_rot = np.zeros((3, model.nv)), np.zeros((3, model.nv))
    for q in np.random.default_rng(0).uniform(task.joint_low, task.joint_high, size=(50, 3)):
        data.qpos[:] = q
        mujoco.mj_forward(model, data)
        np.testing.assert_allclose(task.ee_pos(q), data.site_xpos[site, :2], atol=1e-9)
        mujoco.mj_jacSite(model, data, jac_pos, jac_rot, site)
        np.testing.assert_allclose(task.jacobian(q), jac_pos[:2], atol=1e-9)


@pytest.mark.unit
def test_observed_fingertip_is_where_mujoco_puts_it_after_steps() -> None:
    with reach_backend(2, seed=0, camera=True, image_width=16, image_height=16) as backend:
        backend.reset(seed=0)
        rng = np.random.default_rng(0)
        for _ in range(5):
            obs, *_ = backend.step(rng.uniform(-1, 1, (2, 3)).astype(np.float32))
        sim = backend._sim  # type: ignore[attr-defined]
        site = sim.model.site(reach_mujoco.FINGERTIP_SITE).id
        for i, data in enumerate(sim.datas):
            np.testing.assert_allclose(obs["ee_pos"][i], data.site_xpos[site, :2], atol=1e-6)
            np.testing.assert_allclose(obs["target_pos"][i], data.mocap_pos[0, :2], atol=1e-6)


@pytest.mark.unit
def test_servos_settle_on_their_targets_and_stay_within_limits() -> None:
    task = ReachTask()
    with reach_backend(4, seed=0, max_episode_steps=200) as backend:
        backend.reset(seed=0)
        rng = np.random.default_rng(0)
        for _ in range(150):
            obs, *_ = backend.step(rng.choice([-1.0, 1.0], size=(4, 3)).astype(np.float32))
            assert np.all(np.isfinite(obs["joint_vel"]))
            assert np.all(obs["joint_pos"] >= np.asarray(task.joint_low) - 0.05)
            assert np.all(obs["joint_pos"] <= np.asarray(task.joint_high) + 0.05)
        for _ in range(4):
            obs, *_ = backend.step(np.zeros((4, 3), np.float32))
        sim = backend._sim  # type: ignore[attr-defined]
        np.testing.assert_allclose(obs["joint_pos"], sim.ctrl, atol=0.01)
        assert np.abs(obs["joint_vel"]).max() < 0.2


@pytest.mark.unit
def test_actions_outside_the_range_act_like_full_scale() -> None:
    with reach_backend(1) as big, reach_backend(1) as full:
        big.reset(seed=0)
        full.reset(seed=0)
        for _ in range(3):
            obs_big, *_ = big.step(np.array([[5.0, -3.0, 1.5]], np.float32))
            obs_full, *_ = full.step(np.array([[1.0, -1.0, 1.0]], np.float32))
        np.testing.assert_array_equal(obs_big["joint_pos"], obs_full["joint_pos"])


@pytest.mark.unit
def test_step_info_reports_distance_and_success_of_the_step() -> None:
    with reach_backend(3, seed=0, max_episode_steps=2) as backend:
        backend.reset(seed=0)
        for _ in range(2):
            _, reward, _, truncated, info = backend.step(np.zeros((3, 3), np.float32))
        assert truncated.all()
        last = info["final_obs"]
        expected = np.hypot(*(last["target_pos"] - last["ee_pos"]).T)
        assert info["distance"].dtype == np.float32
        np.testing.assert_allclose(info["distance"], expected, atol=1e-6)
        np.testing.assert_allclose(reward, -info["distance"])
        np.testing.assert_array_equal(info["success"], info["distance"] < 0.05)


@pytest.mark.unit
def test_camera_images_have_the_configured_shape_and_show_the_scene() -> None:
    with reach_backend(2, seed=0, camera=True, image_width=40, image_height=30) as backend:
        obs, _ = backend.reset(seed=0)
        image = obs["image"]
        assert image.dtype == np.uint8 and image.shape == (2, 30, 40, 3)
        assert image.mean() > 40 and image.std() > 10
        # Red target: some pixels far redder than anything else in the scene.
        assert np.any((image[..., 0].astype(int) - image[..., 2]) > 100)
        assert not np.array_equal(image[0], image[1])
        moved, *_ = backend.step(np.ones((2, 3), np.float32))
        assert not np.array_equal(moved["image"], image)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"max_delta": -0.1}, "env.options.max_delta"),
        ({"image_width": 0}, "env.options.image_width"),
        ({"timestep": 0.1}, "env.options.timestep"),
        ({"target_max_radius": 0.4}, "env.options.target_max_radius"),
        ({"camera": "yes"}, "env.options.camera"),
        ({"substep": 3}, "env.options: unknown key"),
    ],
)
def test_bad_option_is_refused_naming_the_field(options: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        make_backend("mujoco_reach", num_envs=1, options=options)


@pytest.mark.unit
def test_reach_env_passes_gymnasium_check_env() -> None:
    with warnings.catch_warnings():
        # Unbounded joint velocities make the observation Box infinite, which check_env notes.
        warnings.filterwarnings("ignore", message=".*infinity.*")
        check_env(gymnasium.make("loopgate/Reach-v0").unwrapped, skip_render_check=True)
        env = gymnasium.make(
            "loopgate/Reach-v0", render_mode="rgb_array", camera=True, image_width=32, image_height=24
        )
        check_env(env.unwrapped)
        env.reset(seed=0)
        assert env.render().shape == (24, 32, 3)  # type: ignore[union-attr]
        env.close()


@pytest.mark.unit
def test_reach_env_truncates_through_time_limit_and_matches_the_backend() -> None:
    env = gymnasium.make("loopgate/Reach-v0", max_episode_steps=3)
    with reach_backend(1, max_episode_steps=3) as backend:
        obs, _ = env.reset(seed=9)
        batch, _ = backend.reset(seed=9)
        for key in batch:
            np.testing.assert_array_equal(obs[key], batch[key][0])
        for t in range(3):
            action = np.full(3, 0.5, np.float32)
            obs, reward, _, truncated, _ = env.step(action)
            batch, rewards, _, truncations, info = backend.step(action[None])
            assert truncated == bool(truncations[0]) == (t == 2)
            assert reward == pytest.approx(float(rewards[0]))
        for key in obs:
            np.testing.assert_array_equal(obs[key], info["final_obs"][key][0])
    env.close()


@pytest.mark.unit
def test_reimporting_the_module_registers_the_gymnasium_id_once() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        importlib.reload(reach_mujoco)
    assert gymnasium.spec("loopgate/Reach-v0").max_episode_steps == 50


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "MUJOCO_GL"} | env
    environ["PYTHONPATH"] = REPO
    return subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=60, cwd=REPO
    )


@pytest.mark.unit
def test_camera_works_without_mujoco_gl_set() -> None:
    result = _python(
        "import os\n"
        "from gateway.factory import make_backend\n"
        "b = make_backend('mujoco_reach', num_envs=1, options={'camera': True, 'image_width': 8, 'image_height': 8})\n"
        "obs, _ = b.reset(seed=0)\n"
        "print(os.environ['MUJOCO_GL'], obs['image'].shape)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] in ("egl", "osmesa")


@pytest.mark.unit
def test_unusable_gl_platform_is_reported_with_what_to_install() -> None:
    result = _python(
        "from gateway.factory import make_backend\n"
        "from sim_bridges.rendering import RenderingUnavailable\n"
        "try:\n"
        "    make_backend('mujoco_reach', num_envs=1, options={'camera': True})\n"
        "except RenderingUnavailable as exc:\n"
        "    print(exc)\n",
        MUJOCO_GL="glfw",
    )
    assert result.returncode == 0, result.stderr
    assert "MUJOCO_GL=glfw" in result.stdout and "apt-get install" in result.stdout


@pytest.mark.unit
def test_forked_async_workers_render_although_the_parent_built_a_camera_env() -> None:
    # gymnasium's AsyncVectorEnv builds one env in the parent before it forks; a GL
    # context made there would hang the children's renderers.
    result = _python(
        "import gymnasium, sim_bridges.mujoco\n"
        "env = gymnasium.make_vec('loopgate/Reach-v0', 2, vectorization_mode='async',\n"
        "                         camera=True, image_width=16, image_height=16)\n"
        "obs, _ = env.reset(seed=0)\n"
        "print(obs['image'].shape, obs['image'].std() > 0)\n"
        "env.close()\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "(2, 16, 16, 3) True"
