"""Proximal policy optimisation (Schulman et al. 2017), on-policy, as rsl_rl and Isaac Lab run it.

Runs in ``trainer.mode: sync``: the trainer takes one rollout (every step of the round
that acted with the current policy version, from a ``fifo`` table with ``links``), then
``epochs`` passes of ``minibatches`` clipped-surrogate updates over it, then publishes
the next version::

    algo = make_algorithm("ppo", spec, net_config, {"epochs": 5}, device=device)
    algo.shard(world); algo.build_optimizers()
    stats = algo.learn(rollout)     # rollout: a transition batch with row / next_row

The old log-probabilities and values are recomputed by the trainer at the start of
:meth:`PPO.learn`: its parameters are exactly the published ones the rollout acted
with (sync mode trains only between rounds, and steps of other versions are left
out), so nothing needs to travel with the steps. The log-probability of a stored
action inverts the actor's tanh squashing (``atanh`` of the action scaled back to
[-1, 1], kept a hair inside the bounds). The entropy bonus is the squashed policy's
(``-log π(a)`` of a fresh reparameterised action, as SAC estimates it): the pre-tanh
Gaussian's entropy would grow without bound by saturating the actions. The KL of the
adaptive learning rate is the pre-tanh Gaussians' (tanh is a bijection: the KL is the same).
Advantages: :mod:`trainer.algos.gae` (terminations end the return, time-outs and the
rollout's edges bootstrap on the critic).

With FSDP every rank holds the whole rollout (broadcast from rank 0), computes the
same advantages, draws the same minibatch order, and trains on its share of each
minibatch; the gradients are averaged.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gateway.episode import EnvSpec
from networks.modules import make_actor, make_encoder, mlp
from trainer.algos import OnPolicyAlgorithm
from trainer.algos.common import clip_groups
from trainer.algos.gae import clipped_surrogate, gae, gaussian_kl, normalise, successors, value_loss
from trainer.algos.options import PPOConfig

_EDGE = 1e-6  # keeps atanh finite for actions on the bounds
_CHUNK = 16384  # rows per no-grad pass over the rollout
_LR_RANGE = (1e-5, 1e-2)  # the adaptive schedule's bounds (rsl_rl's)


class Critic(nn.Module):
    """``V(obs)``: its own encoder and MLP."""

    def __init__(self, spec: EnvSpec, net_config: Any, hidden: tuple[int, ...]) -> None:
        super().__init__()
        self.encoder = make_encoder(spec, net_config)
        self.head = nn.Sequential(
            mlp(self.encoder.out_features, hidden, net_config.activation), nn.Linear(hidden[-1], 1)
        )

    def forward(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = self.head(self.encoder(obs)).squeeze(1)
        return out


def action_log_prob(
    actor: nn.Module, mean: torch.Tensor, log_std: torch.Tensor, action: torch.Tensor
) -> torch.Tensor:
    """Log-density ``[B]`` of stored actions under the actor's tanh-Gaussian ``(mean, log_std)``."""
    half, mid = actor.action_half.reshape(-1), actor.action_mid.reshape(-1)
    unit = ((action.flatten(1).float() - mid) / half).clamp(-1 + _EDGE, 1 - _EDGE)
    pre = torch.atanh(unit)
    gauss = -0.5 * ((pre - mean) / torch.exp(log_std)).pow(2) - log_std - 0.5 * math.log(2 * math.pi)
    jacobian = 2.0 * (math.log(2.0) - pre - nn.functional.softplus(-2.0 * pre))
    return (gauss - jacobian).sum(1) - torch.log(half).sum()


def squashed_entropy(
    actor: nn.Module, mean: torch.Tensor, log_std: torch.Tensor, eps: torch.Tensor
) -> torch.Tensor:
    """One-sample estimate ``[B]`` of the tanh-Gaussian's entropy: ``-log π(a)`` for the
    action ``a = tanh(mean + std·eps)`` (scaled), differentiable through ``mean`` and ``std``."""
    pre = mean + torch.exp(log_std) * eps
    gauss = -0.5 * eps.pow(2) - log_std - 0.5 * math.log(2 * math.pi)
    jacobian = 2.0 * (math.log(2.0) - pre - nn.functional.softplus(-2.0 * pre))
    return -((gauss - jacobian).sum(1) - torch.log(actor.action_half.reshape(-1)).sum())


class PPONetworks(nn.Module):
    """Actor and critic; ``forward`` is a whole minibatch loss, ``evaluate`` the no-grad pass
    over the rollout (one FSDP unit per call, as in SAC)."""

    def __init__(self, actor: nn.Module, critic: Critic) -> None:
        super().__init__()
        self.actor = actor
        self.critic = critic

    def evaluate(
        self, obs: dict[str, torch.Tensor], action: torch.Tensor, next_obs: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        mean, log_std = self.actor.distribution(obs)
        return {
            "old_log_prob": action_log_prob(self.actor, mean, log_std, action),
            "old_mean": mean,
            "old_log_std": log_std,
            "old_value": self.critic(obs),
            "next_value": self.critic(next_obs),
        }

    def forward(
        self, batch: dict[str, torch.Tensor], clip: float, value_clip: float | None
    ) -> dict[str, torch.Tensor]:
        obs = {k[4:]: v for k, v in batch.items() if k.startswith("obs/")}
        mean, log_std = self.actor.distribution(obs)
        log_prob = action_log_prob(self.actor, mean, log_std, batch["action"])
        value = self.critic(obs)
        with torch.no_grad():
            ratio = torch.exp(log_prob - batch["old_log_prob"])
            clipped = ((ratio - 1.0).abs() > clip).float().mean()
            kl = gaussian_kl(batch["old_mean"], batch["old_log_std"], mean, log_std)
        return {
            "policy": clipped_surrogate(log_prob, batch["old_log_prob"], batch["advantage"], clip),
            "value": value_loss(value, batch["old_value"], batch["return"], value_clip),
            "entropy": squashed_entropy(self.actor, mean, log_std, torch.randn_like(mean)).mean(),
            "kl": kl,
            "clip_frac": clipped,
        }


class PPO(OnPolicyAlgorithm):
    def __init__(self, spec: EnvSpec, net_config: Any, config: PPOConfig, *, device: torch.device) -> None:
        super().__init__(spec, net_config, config, device=device)
        hidden = tuple(config.critic_hidden or net_config.hidden_sizes)
        self.nets = PPONetworks(make_actor(spec, net_config), Critic(spec, net_config, hidden)).to(device)
        self._opts: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
        self.rank, self.world_size = 0, 1
        self.rounds = 0
        self.lr = config.lr

    @property
    def actor(self) -> nn.Module:
        return self.nets.actor

    def modules(self) -> dict[str, nn.Module]:
        return {"ppo": self.nets}

    def shard(self, world: Any) -> None:
        from trainer.distributed import shard

        self.rank, self.world_size = world.rank, world.size
        shard(self.nets.actor, world, ("sample", "distribution"))
        shard(self.nets, world, ("evaluate",))

    def build_optimizers(self) -> None:
        self._opts = {"ppo": (self.nets, torch.optim.Adam(self.nets.parameters(), lr=self.config.lr))}

    def optimizers(self) -> dict[str, tuple[nn.Module, torch.optim.Optimizer]]:
        return self._opts

    def min_rollout(self) -> int:
        return self.config.minibatches * self.world_size

    def extra_state(self) -> dict[str, torch.Tensor]:
        return {"lr": torch.tensor([self.lr], dtype=torch.float64), "rounds": torch.tensor([self.rounds])}

    def load_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        self.lr, self.rounds = float(state["lr"][0]), int(state["rounds"][0])

    # ------------------------------------------------------------------ rollout

    def prepare(self, rollout: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The rollout with old log-probs, old values, advantages and returns (no gradients)."""
        obs_keys = [k for k in rollout if k.startswith("obs/")]
        n = len(rollout["reward"])
        parts: list[dict[str, torch.Tensor]] = []
        with torch.no_grad():
            for lo in range(0, n, _CHUNK):
                sl = slice(lo, lo + _CHUNK)
                parts.append(
                    self.nets.evaluate(
                        {k[4:]: rollout[k][sl] for k in obs_keys},
                        rollout["action"][sl],
                        {k[4:]: rollout["next_" + k][sl] for k in obs_keys},
                    )
                )
        out = dict(rollout)
        for key in parts[0]:
            out[key] = torch.cat([p[key] for p in parts]).float()
        succ = successors(rollout["row"], rollout["next_row"])
        adv, ret = gae(
            rollout["reward"],
            rollout["discount"],
            out["old_value"],
            out["next_value"],
            succ,
            self.config.gae_lambda,
        )
        out["return"] = ret
        out["advantage"] = normalise(adv) if self.config.normalize_advantages else adv
        out["linked"] = (succ >= 0).float()
        return out

    def learn(self, rollout: dict[str, torch.Tensor]) -> dict[str, float]:
        """Epochs of minibatch updates over one rollout (the same on every rank); statistics."""
        c = self.config
        for group in self._opts["ppo"][1].param_groups:  # the adaptive rate (restored with a checkpoint)
            group["lr"] = self.lr
        data = self.prepare(rollout)
        n = len(data["reward"])
        per_rank = n // c.minibatches // self.world_size
        if per_rank < 1:
            raise ValueError(
                f"a rollout of {n} steps is too small for {c.minibatches} minibatches over "
                f"{self.world_size} process(es)"
            )
        mb = per_rank * self.world_size
        keys = [k for k in data if k not in ("row", "next_row", "next_value", "linked", "policy_version")]
        keys = [k for k in keys if not k.startswith("next_obs/")]
        self.rounds += 1
        gen = torch.Generator().manual_seed(1_000_003 * self.rounds + 17)  # equal on every rank
        totals: dict[str, float] = {}
        steps = skipped = 0
        for _ in range(c.epochs):
            perm = torch.randperm(n, generator=gen)
            for i in range(c.minibatches):
                idx = perm[i * mb : (i + 1) * mb][self.rank * per_rank : (self.rank + 1) * per_rank]
                idx = idx.to(data["reward"].device)
                stats = self.update({k: data[k][idx] for k in keys})
                if stats.get("skipped"):
                    skipped += 1
                    continue
                steps += 1
                for k, v in stats.items():
                    totals[k] = totals.get(k, 0.0) + v
        out = {k: v / max(steps, 1) for k, v in totals.items() if k != "skipped"}
        out.update(
            {
                "updates": float(c.epochs * c.minibatches),
                "skipped_updates": float(skipped),
                "rollout/steps": float(n),
                "rollout/linked_frac": float(data["linked"].mean()),
                "rollout/value_mean": float(data["old_value"].mean()),
                "rollout/return_mean": float(data["return"].mean()),
                "lr": self.lr,
            }
        )
        return out

    def update(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One clipped-surrogate step on a prepared minibatch (this rank's share)."""
        c, n = self.config, self.nets
        out = n(batch, c.clip, c.value_clip)
        loss = out["policy"] + c.value_coef * out["value"] - c.entropy_coef * out["entropy"]
        opt = self._opts["ppo"][1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        kl = out["kl"].detach()
        if self.world_size > 1:  # every rank adapts the rate alike
            kl = kl.clone()
            dist.all_reduce(kl)
            kl /= self.world_size
        if not clip_groups([list(n.parameters())], c.max_grad_norm)[0]:
            self.skipped_updates += 1
            return {"skipped": 1.0}
        if c.schedule == "adaptive" and torch.isfinite(kl):
            value = float(kl)
            if value > 2.0 * c.desired_kl:
                self.lr = max(_LR_RANGE[0], self.lr / 1.5)
            elif 0.0 < value < 0.5 * c.desired_kl:
                self.lr = min(_LR_RANGE[1], self.lr * 1.5)
            for group in opt.param_groups:
                group["lr"] = self.lr
        opt.step()
        return {
            "skipped": 0.0,
            "loss/policy": float(out["policy"].detach()),
            "loss/value": float(out["value"].detach()),
            "entropy": float(out["entropy"].detach()),
            "kl": float(kl),
            "clip_frac": float(out["clip_frac"]),
        }
