"""PPO learns the MuJoCo reach on an update budget: real MuJoCo arms, the real replay buffer
(chunks in, the rollout table drained each round), the trainer's PPO, in one process.

The whole loop under ``loopgate up`` is in ``test_trainer_ppo_e2e.py``; this one is the
learning claim, in process so that it fits the CI budget."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gateway.trajectory import StepRows, episode_id
from networks.config import NetworkConfig
from sim_bridges.mujoco import MujocoReachBackend, MujocoReachConfig
from trainer.algos import make_algorithm
from trainer.replay.config import ReplayConfig, TableConfig
from trainer.replay.core import ReplayBuffer
from trainer.rollout import drain

pytestmark = pytest.mark.unit

ENVS, STEPS_PER_ENV, ROUNDS = 64, 32, 40
TASK = MujocoReachConfig(max_episode_steps=50, success_radius=0.05)
OPTIONS = {
    "gamma": 0.95,
    "gae_lambda": 0.9,
    "epochs": 5,
    "minibatches": 4,
    "lr": 1e-3,
    "schedule": "fixed",
    "entropy_coef": 0.05,
}


class _Buffer:
    """The two replay-client calls the drain makes, answered by the buffer in this process."""

    def __init__(self, buffer: ReplayBuffer) -> None:
        self.buffer = buffer

    def status(self, timeout_s: float) -> dict:
        return self.buffer.state()

    def take(self, counts: dict[str, int], timeout_s: float) -> dict:
        return self.buffer.sample(counts)


def evaluate(actor: torch.nn.Module, envs: int = 32) -> tuple[float, float]:
    """Mean return and success rate of one deterministic episode per env (held-out seed)."""
    backend = MujocoReachBackend(TASK, num_envs=envs, seed=123)
    try:
        obs, _ = backend.reset(seed=123)
        ret, success, done = np.zeros(envs), np.zeros(envs, bool), np.zeros(envs, bool)
        for _ in range(TASK.max_episode_steps):
            with torch.no_grad():
                tensors = {k: torch.from_numpy(v) for k, v in obs.items()}
                action = actor(tensors, torch.zeros(envs, 3)).numpy()
            obs, reward, terminated, truncated, info = backend.step(action)
            ret += np.where(done, 0.0, reward)
            success |= ~done & info["success"]
            done |= terminated | truncated
        return float(ret.mean()), float(success.mean())
    finally:
        backend.close()


class Collector:
    """Envs acting with the actor's stochastic policy; each episode's steps go to the buffer
    as trajectory chunks (at its end, with the final observation, and at each round's end)."""

    def __init__(self, buffer: ReplayBuffer) -> None:
        self.backend = MujocoReachBackend(TASK, num_envs=ENVS, seed=0)
        self.obs, _ = self.backend.reset(seed=0)
        self.buffer = buffer
        self.episode = np.zeros(ENVS, np.int64)
        self.step = np.zeros(ENVS, np.int64)
        self.rows = [StepRows(episode_id("w", i, 0), "w", i, "reach") for i in range(ENVS)]

    def round(self, actor: torch.nn.Module, version: int) -> None:
        for _ in range(STEPS_PER_ENV):
            with torch.no_grad():
                tensors = {k: torch.from_numpy(v) for k, v in self.obs.items()}
                action = actor(tensors, torch.randn(ENVS, 3)).numpy().astype(np.float32)
            obs, reward, terminated, truncated, info = self.backend.step(action)
            for i in range(ENVS):
                self.rows[i].add(
                    {k: v[i] for k, v in self.obs.items()},
                    action[i],
                    reward=reward[i],
                    terminated=terminated[i],
                    truncated=truncated[i],
                    success=info["success"][i],
                    policy_version=version,
                    t_capture=0.0,
                    t_action=0.0,
                    step=self.step[i],
                )
                self.step[i] += 1
                if terminated[i] or truncated[i]:
                    final = {k: v[i] for k, v in info["final_obs"].items()}
                    end = "terminated" if terminated[i] else "truncated"
                    self.buffer.insert(self.rows[i].to_chunk(end=end, final_obs=final))
                    self.episode[i] += 1
                    self.step[i] = 0
                    self.rows[i] = StepRows(episode_id("w", i, int(self.episode[i])), "w", i, "reach")
            self.obs = obs
        for rows in self.rows:  # the round ends: open episodes hand over what they have
            if len(rows):
                self.buffer.insert(rows.take(len(rows)).to_chunk())

    def close(self) -> None:
        self.backend.close()


@pytest.mark.timeout(240)
def test_ppo_learns_to_reach_far_above_the_untrained_policy():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    algo = make_algorithm(
        "ppo",
        TASK.spec(),
        NetworkConfig(hidden_sizes=(64, 64), activation="elu"),
        OPTIONS,
        device=torch.device("cpu"),
    )
    algo.build_optimizers()
    table = TableConfig(
        name="rollout", sampler="fifo", max_times_sampled=1, links=True, gamma=0.95, max_size=50_000
    )
    buffer = ReplayBuffer(ReplayConfig(tables=[table]))
    untrained = evaluate(algo.actor)
    collector = Collector(buffer)
    kept, stale, linked = [], [], []
    try:
        for version in range(1, ROUNDS + 1):
            collector.round(algo.actor, version)
            arrays, info = drain(_Buffer(buffer), "rollout", version, timeout_s=1.0)
            kept.append(info["kept"])
            stale.append(info["stale"])
            stats = algo.learn({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()})
            assert stats["skipped_updates"] == 0
            linked.append(stats["rollout/linked_frac"])
    finally:
        collector.close()
    trained = evaluate(algo.actor)
    # The last step of an episode still open at a round's end waits for the next
    # observation, which comes with the next round's first chunk: it arrives a version
    # late and is dropped. Every other step is trained on, once.
    assert stale[0] == 0 and all(0 <= s <= ENVS for s in stale) and sum(stale) > 0, stale
    assert all(ENVS * (STEPS_PER_ENV - 1) <= k <= ENVS * STEPS_PER_ENV for k in kept)
    assert min(linked) > 0.8  # GAE follows most steps to their successor
    assert trained[0] > untrained[0] + 5.0, (untrained, trained)
    assert trained[1] >= max(0.6, untrained[1] + 0.4), (untrained, trained)
