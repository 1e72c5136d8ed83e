"""PPO's pieces against hand-computed values: GAE with time-outs and terminations, the
clipped losses, advantage normalisation; the rollout table; the config checks (real torch,
the real replay buffer, one process)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gateway.config import ConfigError, build, from_dict, load_config
from gateway.protocol import Message
from gateway.trajectory import StepRows
from networks.config import NetworkConfig
from sim_bridges.reach import ReachTask
from tests.conftest import REPO, time_left
from trainer.algos import make_algorithm
from trainer.algos.gae import clipped_surrogate, gae, gaussian_kl, normalise, successors, value_loss
from trainer.algos.ppo import PPOConfig, action_log_prob, squashed_entropy
from trainer.replay.config import ReplayConfig, TableConfig
from trainer.replay.core import ReplayBuffer, Waiting
from trainer.rollout import TAKE_BYTES, drain, item_bytes
from trainer.services import preflight

pytestmark = pytest.mark.unit
torch.set_num_threads(1)
SPEC = ReachTask().spec(max_episode_steps=50)
NET = NetworkConfig(hidden_sizes=(32, 32))
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# Three episodes' steps, shuffled: A ends terminated at row 12 (next_row = its own row);
# B is truncated (a time-out) at row 21, whose next observation is the final one (row 22,
# no item); C is cut by the round's end at row 31 (its next step, row 32, is not in it).
ROWS = {10: 11, 11: 12, 12: 12, 20: 21, 21: 22, 30: 31, 31: 32}
ORDER = [21, 10, 31, 12, 20, 11, 30]
REWARD = {10: 1.0, 11: 2.0, 12: 3.0, 20: 0.0, 21: 1.0, 30: 1.0, 31: 1.0}
VALUE = {10: 0.5, 11: 1.0, 12: 1.5, 20: 2.0, 21: 2.0, 30: 0.0, 31: 0.0}
NEXT_VALUE = {10: 1.0, 11: 1.5, 12: 99.0, 20: 2.0, 21: 4.0, 30: 0.0, 31: 10.0}
GAMMA, LAM = 0.9, 0.5


def rollout(terminal_b: bool = False) -> dict[str, torch.Tensor]:
    discount = {r: (0.0 if r == 12 or (terminal_b and r == 21) else GAMMA) for r in ORDER}
    return {
        "row": torch.tensor(ORDER),
        "next_row": torch.tensor([ROWS[r] for r in ORDER]),
        "reward": t(*[REWARD[r] for r in ORDER]),
        "discount": t(*[discount[r] for r in ORDER]),
        "value": t(*[VALUE[r] for r in ORDER]),
        "next_value": t(*[NEXT_VALUE[r] for r in ORDER]),
    }


def advantages(terminal_b: bool = False) -> dict[int, float]:
    r = rollout(terminal_b)
    succ = successors(r["row"], r["next_row"])
    adv, ret = gae(r["reward"], r["discount"], r["value"], r["next_value"], succ, LAM)
    assert torch.allclose(ret, adv + r["value"])
    return {row: float(a) for row, a in zip(ORDER, adv, strict=True)}


def test_successors_follow_next_row_and_stop_at_ends():
    r = rollout()
    succ = successors(r["row"], r["next_row"]).tolist()
    got = {ORDER[i]: (ORDER[j] if j >= 0 else None) for i, j in enumerate(succ)}
    assert got == {10: 11, 11: 12, 12: None, 20: 21, 21: None, 30: 31, 31: None}


def test_gae_stops_at_terminations_and_bootstraps_time_outs_and_round_edges():
    adv = advantages()
    # A: terminated at 12, whose next value (99) must not count.
    a12 = 3.0 - 1.5
    a11 = (2.0 + 0.9 * 1.5 - 1.0) + 0.9 * 0.5 * a12
    a10 = (1.0 + 0.9 * 1.0 - 0.5) + 0.9 * 0.5 * a11
    # B: the time-out at 21 bootstraps on V(final observation) = 4.
    a21 = 1.0 + 0.9 * 4.0 - 2.0
    a20 = (0.0 + 0.9 * 2.0 - 2.0) + 0.9 * 0.5 * a21
    # C: the round ends after 31: bootstrap on V(next observation) = 10.
    a31 = 1.0 + 0.9 * 10.0 - 0.0
    a30 = 1.0 + 0.9 * 0.0 - 0.0 + 0.9 * 0.5 * a31
    want = {10: a10, 11: a11, 12: a12, 20: a20, 21: a21, 30: a30, 31: a31}
    assert want == pytest.approx({10: 2.76125, 11: 3.025, 12: 1.5, 20: 0.97, 21: 2.6, 30: 5.5, 31: 10.0})
    assert adv == pytest.approx(want, abs=1e-5)


def test_a_termination_where_a_time_out_was_drops_the_bootstrap():
    timed_out, terminated = advantages(), advantages(terminal_b=True)
    assert terminated[21] == pytest.approx(1.0 - 2.0)  # r - V: no V(s') at all
    assert terminated[20] == pytest.approx(-0.2 + 0.45 * -1.0)
    assert timed_out[21] - terminated[21] == pytest.approx(0.9 * 4.0)
    assert {k: v for k, v in terminated.items() if k not in (20, 21)} == pytest.approx(
        {k: v for k, v in timed_out.items() if k not in (20, 21)}
    )


def test_advantage_normalisation_uses_the_rollouts_mean_and_unbiased_std():
    out = normalise(t(1.0, 2.0, 3.0, 4.0))
    std = math.sqrt(5.0 / 3.0)
    assert out.tolist() == pytest.approx([-1.5 / std, -0.5 / std, 0.5 / std, 1.5 / std], abs=1e-6)


def test_clipped_surrogate_takes_the_pessimistic_side_of_the_clip():
    old = t(0.0, 0.0, 0.0, 0.0)
    logp = torch.log(t(1.5, 1.5, 0.5, 0.5))
    adv = t(1.0, -1.0, 1.0, -1.0)
    # ratio 1.5, A>0: clipped to 1.2; A<0: unclipped -1.5; ratio 0.5, A>0: 0.5; A<0: clipped -0.8.
    want = -(1.2 - 1.5 + 0.5 - 0.8) / 4
    assert float(clipped_surrogate(logp, old, adv, 0.2)) == pytest.approx(want)
    inside = torch.log(t(1.1, 0.9))
    assert float(clipped_surrogate(inside, t(0.0, 0.0), t(2.0, 2.0), 0.2)) == pytest.approx(-(2.2 + 1.8) / 2)


def test_value_loss_clips_around_the_old_value():
    value, old, ret = t(1.0, 0.1), t(0.0, 0.0), t(2.0, 2.0)
    # 1.0 leaves the clip (0.2): max((1-2)^2, (0.2-2)^2) = 3.24; 0.1 stays inside: (0.1-2)^2.
    assert float(value_loss(value, old, ret, 0.2)) == pytest.approx((3.24 + 1.9**2) / 2)
    assert float(value_loss(value, old, ret, None)) == pytest.approx((1.0 + 1.9**2) / 2)


def test_gaussian_kl_matches_the_closed_form():
    kl = gaussian_kl(
        t(0.0).reshape(1, 1), t(0.0).reshape(1, 1), t(1.0).reshape(1, 1), t(math.log(2)).reshape(1, 1)
    )
    assert float(kl) == pytest.approx(math.log(2) + (1 + 1) / (2 * 4) - 0.5)


def test_the_entropy_bonus_is_the_squashed_policys_and_does_not_reward_saturation():
    class Unit(torch.nn.Module):  # actions in [-1, 1]
        action_half = torch.ones(1)

    def estimate(log_std: float) -> float:
        g = torch.Generator().manual_seed(0)
        eps = torch.randn(200_000, 1, generator=g)
        mean, ls = torch.zeros(200_000, 1), torch.full((200_000, 1), log_std)
        return float(squashed_entropy(Unit(), mean, ls, eps).mean())

    def exact(log_std: float) -> float:  # H[tanh(u)] = H[u] + E[log(1 - tanh(u)^2)], by quadrature
        std = math.exp(log_std)
        u = np.linspace(-12 * std, 12 * std, 400_001)
        density = np.exp(-0.5 * (u / std) ** 2) / (std * math.sqrt(2 * math.pi))
        jac = 2 * (math.log(2) - np.abs(u) - np.log1p(np.exp(-2 * np.abs(u))))  # log(1 - tanh(u)^2)
        return log_std + 0.5 * math.log(2 * math.pi * math.e) + float(np.trapezoid(density * jac, u))

    for log_std in (-2.0, 0.0, 2.0):
        assert estimate(log_std) == pytest.approx(exact(log_std), abs=0.02)
    # The Gaussian's entropy grows with std; the squashed one peaks and falls as actions saturate.
    assert estimate(0.0) > estimate(2.0) and estimate(0.0) > estimate(-2.0)


def test_log_prob_of_a_stored_action_is_the_actors_own():
    torch.manual_seed(0)
    algo = make_algorithm("ppo", SPEC, NET, {}, device=torch.device("cpu"))
    actor = algo.actor
    obs = {k: torch.randn(16, *a.shape) for k, a in SPEC.observation.items()}
    with torch.no_grad():
        action, log_prob = actor.sample(obs)
        mean, log_std = actor.distribution(obs)
        again = action_log_prob(actor, mean, log_std, action)
    assert torch.allclose(again, log_prob, atol=1e-3)


def test_prepared_rollout_starts_every_ratio_at_one():
    torch.manual_seed(0)
    algo = make_algorithm("ppo", SPEC, NET, {"minibatches": 2, "epochs": 1}, device=torch.device("cpu"))
    algo.build_optimizers()
    n = 64
    obs = {f"obs/{k}": torch.randn(n, *a.shape) for k, a in SPEC.observation.items()}
    with torch.no_grad():
        action, _ = algo.actor.sample({k[4:]: v for k, v in obs.items()})
    batch = {
        **obs,
        **{"next_" + k: v + 0.1 for k, v in obs.items()},
        "action": action,
        "reward": torch.randn(n),
        "discount": torch.full((n,), 0.95),
        "row": torch.arange(n),
        "next_row": torch.arange(n) + 1,
        "policy_version": torch.ones(n, dtype=torch.int64),
    }
    data = algo.prepare(batch)
    out = algo.nets({k: v for k, v in data.items() if not k.startswith("next_")}, 0.2, 0.2)
    assert float(out["clip_frac"]) == 0.0 and float(out["kl"]) == pytest.approx(0.0, abs=1e-6)
    assert float(out["policy"].detach()) == pytest.approx(-float(data["advantage"].mean()), abs=1e-5)
    assert data["linked"].sum() == n - 1  # one chain: the last step's next row is not in it
    stats = algo.learn(batch)
    assert stats["updates"] == 2 and stats["rollout/steps"] == n and stats["skipped_updates"] == 0


def test_a_rollout_too_small_for_the_minibatches_is_refused():
    algo = make_algorithm("ppo", SPEC, NET, {"minibatches": 8}, device=torch.device("cpu"))
    algo.build_optimizers()
    n = 4
    obs = {f"obs/{k}": torch.zeros(n, *a.shape) for k, a in SPEC.observation.items()}
    batch = {**obs, **{"next_" + k: v for k, v in obs.items()}, "action": torch.zeros(n, 3)}
    batch.update(
        reward=torch.zeros(n), discount=torch.zeros(n), row=torch.arange(n), next_row=torch.arange(n)
    )
    with pytest.raises(ValueError, match="too small for 8 minibatches"):
        algo.learn(batch)


# --------------------------------------------------------------- rollout table


def chunk(episode: str, first: int, n: int, version: int, end: str | None = None) -> Message:
    rows = StepRows(episode, "w", 0, "reach")
    for i in range(first, first + n):
        rows.add(
            {k: np.full(a.shape, i, np.float32) for k, a in SPEC.observation.items()},
            np.zeros(3, np.float32),
            reward=float(i),
            terminated=end == "terminated" and i == first + n - 1,
            truncated=end == "truncated" and i == first + n - 1,
            success=False,
            policy_version=version,
            t_capture=0.0,
            t_action=0.0,
            step=i,
        )
    final = (
        {k: np.full(a.shape, -1, np.float32) for k, a in SPEC.observation.items()}
        if end == "truncated"
        else None
    )
    return rows.to_chunk(end=end, final_obs=final)


class _InProcess:
    """The replay client's two calls the drain makes, answered by a buffer in this process."""

    def __init__(self, buffer: ReplayBuffer) -> None:
        self.buffer = buffer
        self.requests: list[int] = []

    def status(self, timeout_s: float) -> dict:
        return self.buffer.state()

    def take(self, counts: dict[str, int], timeout_s: float) -> dict:
        self.requests.append(sum(counts.values()))
        return self.buffer.sample(counts)


def rollout_buffer() -> ReplayBuffer:
    table = TableConfig(name="rollout", sampler="fifo", max_times_sampled=1, links=True, gamma=0.9)
    return ReplayBuffer(ReplayConfig(tables=[table]))


def test_the_rollout_table_links_each_episodes_steps_and_hands_each_out_once():
    buffer = rollout_buffer()
    buffer.insert(chunk("a", 0, 4, version=3))
    buffer.insert(chunk("b", 0, 3, version=3, end="truncated"))
    buffer.insert(chunk("a", 4, 2, version=3, end="terminated"))
    arrays, info = drain(_InProcess(buffer), "rollout", 3, timeout_s=1.0)
    assert info == {"taken": 9, "kept": 9, "stale": 0}
    succ = successors(torch.from_numpy(arrays["row"]), torch.from_numpy(arrays["next_row"]))
    step = arrays["obs/" + next(iter(SPEC.observation))][:, 0]
    # Follow the chains by observation value: a 0->1->...->5 (across its two chunks), b 0->1->2.
    chains = []
    for start in np.flatnonzero(step == 0):
        chain, i = [], int(start)
        while i >= 0:
            chain.append(int(step[i]))
            i = int(succ[i])
        chains.append(chain)
    assert sorted(chains) == [[0, 1, 2], [0, 1, 2, 3, 4, 5]]
    truncated = np.flatnonzero(arrays["truncated"])
    assert len(truncated) == 1 and arrays["discount"][truncated[0]] == pytest.approx(0.9)
    assert (arrays["next_obs/" + next(iter(SPEC.observation))][truncated[0]] == -1).all()
    assert arrays["discount"][np.flatnonzero(arrays["terminated"])[0]] == 0.0
    with pytest.raises(Waiting):  # each step once: the table is empty now
        buffer.sample({"rollout": 1})
    assert drain(_InProcess(buffer), "rollout", 3, timeout_s=1.0)[1] == {"taken": 0, "kept": 0, "stale": 0}


def test_large_items_are_drained_in_several_requests_each_step_once():
    buffer = rollout_buffer()
    buffer.insert(chunk("a", 0, 9, version=1, end="terminated"))
    client = _InProcess(buffer)
    arrays, info = drain(client, "rollout", 1, timeout_s=1.0, per_item=TAKE_BYTES // 4)
    assert client.requests == [4, 4, 1] and info["kept"] == 9
    assert sorted(arrays["row"].tolist()) == sorted(set(arrays["row"].tolist()))
    obs = sum(4 * int(np.prod(a.shape)) for a in SPEC.observation.values())  # float32
    assert item_bytes(SPEC) == 2 * obs + 3 * 4 + 64


def test_steps_of_an_older_version_are_dropped_and_counted():
    buffer = rollout_buffer()
    buffer.insert(chunk("a", 0, 4, version=1))
    buffer.insert(chunk("a", 4, 4, version=2, end="terminated"))
    arrays, info = drain(_InProcess(buffer), "rollout", 2, timeout_s=1.0)
    assert info == {"taken": 8, "kept": 4, "stale": 4}
    assert (arrays["policy_version"] == 2).all()


def test_a_table_without_links_cannot_feed_ppo():
    buffer = ReplayBuffer(
        ReplayConfig(tables=[TableConfig(name="rollout", sampler="fifo", max_times_sampled=1)])
    )
    buffer.insert(chunk("a", 0, 4, version=1, end="terminated"))
    with pytest.raises(ValueError, match="needs links: true"):
        drain(_InProcess(buffer), "rollout", 1, timeout_s=1.0)


# ----------------------------------------------------------------------- config


def test_reach_ppo_config_passes_the_preflight():
    from gateway.factory import experiment_spec

    cfg = load_config(CONFIGS / "reach_ppo.yaml")
    assert cfg.trainer.algorithm == "ppo" and cfg.trainer.mode == "sync"
    preflight(cfg, experiment_spec(cfg.env.backend, dict(cfg.env.options)))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"trainer": {"mode": "async"}}, "needs trainer.mode: sync"),
        ({"replay": {"sampler": "uniform"}}, r"replay.tables\[0\].sampler must be 'fifo'"),
        ({"replay": {"links": False}}, r"replay.tables\[0\].links must be True"),
        ({"replay": {"max_times_sampled": 0}}, "max_times_sampled must be 1"),
        ({"replay": {"max_size": 100}}, "must hold a whole round"),
        (
            {"trainer": {"collect_steps": 1000}},
            r"rollout_steps \(32\) × env.workers × env.num_envs \(32\) = 1024",
        ),
        ({"options": {"gamma": 0.99}}, "differs from trainer.options.gamma"),
    ],
)
def test_experiments_ppo_cannot_train_are_refused_before_anything_starts(change, message):
    from gateway.factory import experiment_spec

    data = load_config(CONFIGS / "reach_ppo.yaml").to_dict()
    data["trainer"].update(change.get("trainer", {}))
    data["trainer"]["options"].update(change.get("options", {}))
    data["replay"]["tables"][0].update(change.get("replay", {}))
    cfg = from_dict(data)
    with pytest.raises(ConfigError, match=message):
        preflight(cfg, experiment_spec(cfg.env.backend, dict(cfg.env.options)))


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"clip": 0.0}, "trainer.options.clip"),
        ({"gae_lambda": 1.5}, "trainer.options.gae_lambda"),
        ({"epochs": 0}, "trainer.options.epochs"),
        ({"minibatches": 0}, "trainer.options.minibatches"),
        ({"schedule": "cosine"}, "trainer.options.schedule"),
        ({"entropy_coef": -1.0}, "trainer.options.entropy_coef"),
        ({"rollout_steps": 0}, "trainer.options.rollout_steps"),
        ({"value_clip": 0.0}, "trainer.options.value_clip"),
    ],
)
def test_bad_ppo_options_name_the_field(options, field):
    with pytest.raises((ConfigError, ValueError), match=field):
        build(PPOConfig, options, "trainer.options")


def test_links_are_refused_on_items_other_than_transitions():
    with pytest.raises(ConfigError, match=r"replay.tables\[0\].links is only for item 'transition'"):
        ReplayConfig(tables=[TableConfig(item="sequence", links=True)])


def test_a_checkpoint_brings_back_the_actor_the_adaptive_rate_and_the_round_count(tmp_path):
    """In its own process (a process group of one, DCP), as the trainer checkpoints."""
    out = tmp_path / "out.json"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "tests" / "scripts" / "ppo_checkpoint.py"),
            str(tmp_path / "ckpt"),
            str(out),
        ],
        check=True,
        timeout=time_left(),
        cwd=REPO,
    )
    got = json.loads(out.read_text())
    assert got["counters"] == {"updates": 60, "version": 3, "samples": 0}
    assert got["after"] == got["before"] and got["before"]["rounds"] == 3
    assert got["before"]["lr"] != 3e-3  # the adaptive schedule moved it, and it came back
    assert got["same_actor"]
