"""The torch reach simulator: Isaac Lab's env semantics on real torch tensors, and the
``torch_reach`` backend through the Isaac Lab adapter (the episode conformance suite)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from gateway.factory import experiment_spec, make_backend
from sim_bridges.torch_reach import OBS_DIM, OBS_LAYOUT, TorchReachConfig, TorchReachEnv
from tests.conformance.episode_backend import EpisodeBackendConformance

pytestmark = pytest.mark.unit


class TestTorchReachConformance(EpisodeBackendConformance):
    num_envs = 4

    def make_backend(self, num_envs: int, seed: int, *, max_episode_steps: int | None = None) -> Any:
        options = {} if max_episode_steps is None else {"episode_length": max_episode_steps}
        return make_backend("torch_reach", num_envs=num_envs, seed=seed, options=options)


def env(n: int = 64, **options: Any) -> TorchReachEnv:
    return TorchReachEnv(TorchReachConfig(**options), num_envs=n, seed=0)


def test_observations_are_one_policy_group_tensor_on_the_env_device():
    e = env(8)
    obs, extras = e.reset()
    assert set(obs) == {"policy"} and extras == {}
    policy = obs["policy"]
    assert policy.shape == (8, OBS_DIM) and policy.dtype == torch.float32 and policy.device == e.device
    ee, target = policy[:, OBS_LAYOUT["ee_pos"]], policy[:, OBS_LAYOUT["target_pos"]]
    torch.testing.assert_close(policy[:, OBS_LAYOUT["target_rel"]], target - ee)
    assert e.single_observation_space["policy"].shape == (OBS_DIM,)
    assert e.unwrapped is e


def test_time_outs_come_at_the_episode_length_and_reset_in_the_same_step():
    e = env(16, episode_length=5)
    e.reset()
    for t in range(1, 11):
        obs, reward, terminated, time_outs, extras = e.step(torch.full((16, 3), 0.5))
        assert reward.shape == (16,) and reward.dtype == torch.float32
        assert not terminated.any()
        if t % 5:
            assert not time_outs.any() and "log" not in extras
            continue
        assert time_outs.all()
        # The returned observation is the next episode's first: no terminal obs anywhere.
        first = obs["policy"]
        assert torch.all(first[:, OBS_LAYOUT["joint_vel"]] == 0)
        assert torch.all(first[:, OBS_LAYOUT["last_action"]] == 0)
        assert extras["log"]["Episode_Termination/time_out"] == 16


def test_done_buffers_are_modified_in_place_by_the_next_step_as_in_isaac_lab():
    e = env(4, episode_length=2)
    e.reset()
    _, _, terminated, time_outs, _ = e.step(torch.zeros(4, 3))
    _, _, terminated2, time_outs2, _ = e.step(torch.zeros(4, 3))
    assert time_outs2 is time_outs and terminated2 is terminated  # the env's own buffers
    kept = time_outs.clone()
    e.step(torch.zeros(4, 3))
    assert kept.all() and not time_outs.any()  # a clone survives, the buffer does not


def test_reaching_the_target_terminates_when_asked():
    e = env(2, terminate_on_success=True, success_radius=10.0)  # any fingertip position succeeds
    e.reset()
    _, _, terminated, time_outs, extras = e.step(torch.zeros(2, 3))
    assert terminated.all() and not time_outs.any()
    assert extras["log"]["Episode_Termination/success"] == 2


def test_random_start_spreads_the_first_time_outs():
    e = env(256, episode_length=50, random_start=True)
    e.reset()
    first = torch.full((256,), -1)
    for t in range(50):
        _, _, _, time_outs, _ = e.step(torch.zeros(256, 3))
        first[time_outs & (first < 0)] = t
    assert (first >= 0).all() and len(torch.unique(first)) > 20


def test_same_seed_same_trajectory_and_actions_move_the_arm_toward_the_target():
    a, b = env(32), env(32)
    oa, _ = a.reset(seed=3)
    ob, _ = b.reset(seed=3)
    torch.testing.assert_close(oa["policy"], ob["policy"])
    rel = OBS_LAYOUT["target_rel"]
    start = torch.linalg.vector_norm(oa["policy"][:, rel], dim=1)
    obs = oa
    for _ in range(60):  # a Jacobian-transpose controller: the task is solvable
        q = obs["policy"][:, OBS_LAYOUT["joint_pos"]]
        err = obs["policy"][:, rel]
        angles = torch.cumsum(q, dim=1)
        links = torch.tensor([0.35, 0.3, 0.25])
        jx = -torch.flip(torch.cumsum(torch.flip(links * torch.sin(angles), [1]), 1), [1])
        jy = torch.flip(torch.cumsum(torch.flip(links * torch.cos(angles), [1]), 1), [1])
        action = (jx * err[:, :1] + jy * err[:, 1:]) * 4.0
        obs, *_ = a.step(action.clamp(-1, 1))
        b.step(action.clamp(-1, 1))
    end = torch.linalg.vector_norm(obs["policy"][:, rel], dim=1)
    assert end.median() < 0.5 * start.median()
    torch.testing.assert_close(a.joint_pos, b.joint_pos)


@pytest.mark.parametrize(
    ("action", "match"),
    [
        (torch.zeros(5, 3), r"shape \[5, 3\], expected \[4, 3\]"),
        (torch.zeros(4, 2), r"shape \[4, 2\], expected \[4, 3\]"),
        (torch.zeros(4, 3, dtype=torch.int64), "floating-point"),
        (np.zeros((4, 3), np.float32), "torch.Tensor"),
        (torch.zeros(4, 3, device="meta"), "is on meta"),
    ],
)
def test_bad_actions_are_refused_with_what_was_expected(action, match):
    e = env(4)
    e.reset()
    with pytest.raises((ValueError, TypeError), match=match):
        e.step(action)
    e.step(torch.zeros(4, 3))  # and the env goes on


def test_bad_options_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="episode_length"):
        TorchReachConfig(episode_length=0)
    with pytest.raises(ValueError, match="device"):
        TorchReachConfig(device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            TorchReachConfig(device="cuda")
    with pytest.raises(ValueError, match="num_envs"):
        TorchReachEnv(TorchReachConfig(), num_envs=0)


def test_the_backend_spec_is_readable_before_anything_runs():
    spec = experiment_spec("torch_reach", {"episode_length": 30})
    assert spec.name == "torch_reach" and spec.max_episode_steps == 30
    assert spec.observation["policy"].shape == (OBS_DIM,) and spec.action.shape == (3,)
    assert spec.control_hz == pytest.approx(20.0)
