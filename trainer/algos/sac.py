"""Soft actor-critic (Haarnoja et al. 2018) with twin critics and a learned temperature.

Off-policy: batches of transitions from the replay service (``obs/*``, ``action``,
``reward``, ``next_obs/*``, ``terminated`` and ``discount``, the whole bootstrap factor:
the table's gamma, gamma^k for n-step items, 0 after termination). ``gamma`` here is used
only for batches without ``discount``; the trainer's preflight makes the two agree.
Sampling from a demonstrations table and an online table with fixed ratios gives RLPD-
style RL from demonstrations with the same update.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from gateway.episode import EnvSpec
from networks.modules import make_actor, make_encoder, mlp
from trainer.algos import Algorithm
from trainer.algos.common import clip_groups, soft_update
from trainer.algos.options import SACConfig


class TwinCritic(nn.Module):
    """Two Q networks ``Q(obs, action)``, each with its own encoder and MLP."""

    def __init__(self, spec: EnvSpec, net_config: Any, hidden: tuple[int, ...]) -> None:
        super().__init__()
        action_dim = math.prod(spec.action.shape)
        self.encoders = nn.ModuleList([make_encoder(spec, net_config) for _ in range(2)])
        width = self.encoders[0].out_features + action_dim
        self.heads = nn.ModuleList(
            [
                nn.Sequential(mlp(width, hidden, net_config.activation), nn.Linear(hidden[-1], 1))
                for _ in range(2)
            ]
        )

    def forward(
        self, obs: dict[str, torch.Tensor], action: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        flat = action.flatten(1)
        q = [
            head(torch.cat([enc(obs), flat], dim=1)).squeeze(1)
            for enc, head in zip(self.encoders, self.heads)
        ]
        return q[0], q[1]


class SACNetworks(nn.Module):
    """Actor, twin critics, their targets and the temperature; ``forward`` is a whole SAC loss.

    One module with one forward per update is what makes FSDP cheap: its parameters are
    gathered once per update and its gradients reduced once, instead of once per
    network call (a dozen collectives per update, which dominated on CPU). The three
    losses touch disjoint parameters (the actor's loss sees the critics through
    detached parameters), so one backward of their sum gives each its own gradient.
    """

    def __init__(
        self, actor: nn.Module, critic: TwinCritic, init_alpha: float, target_entropy: float
    ) -> None:
        super().__init__()
        self.actor = actor
        self.critic = critic
        self.target = copy.deepcopy(critic)
        self.target.requires_grad_(False)
        self.log_alpha = nn.Parameter(torch.tensor([math.log(init_alpha)]))
        self.target_entropy = target_entropy

    def forward(self, batch: dict[str, torch.Tensor], gamma: float) -> dict[str, torch.Tensor]:
        obs = {k[4:]: v for k, v in batch.items() if k.startswith("obs/")}
        next_obs = {k[9:]: v for k, v in batch.items() if k.startswith("next_obs/")}
        action, reward = batch["action"], batch["reward"].float()
        not_done = 1.0 - batch["terminated"].float()
        discount = batch["discount"].float() if "discount" in batch else torch.full_like(reward, gamma)
        log_alpha = self.log_alpha.float()
        alpha = log_alpha.exp().detach()
        with torch.no_grad():
            next_action, next_logp = self.actor.sample(next_obs)
            tq1, tq2 = self.target(next_obs, next_action)
            target_q = reward + discount * not_done * (torch.min(tq1, tq2) - alpha * next_logp)
        q1, q2 = self.critic(obs, action)
        critic_loss = 0.5 * ((q1 - target_q).pow(2).mean() + (q2 - target_q).pow(2).mean())
        new_action, logp = self.actor.sample(obs)
        frozen = {name: p.detach() for name, p in self.critic.named_parameters()}
        pq1, pq2 = torch.func.functional_call(self.critic, frozen, (obs, new_action))
        actor_loss = (alpha * logp - torch.min(pq1, pq2)).mean()
        alpha_loss = -(log_alpha * (logp.detach() + self.target_entropy)).mean()
        return {
            "critic": critic_loss,
            "actor": actor_loss,
            "alpha": alpha_loss,
            "q": q1.detach().mean(),
            "entropy": -logp.detach().mean(),
            "alpha_value": alpha,
        }


class SAC(Algorithm):
    def __init__(self, spec: EnvSpec, net_config: Any, config: SACConfig, *, device: torch.device) -> None:
        super().__init__(spec, net_config, config, device=device)
        hidden = config.critic_hidden or net_config.hidden_sizes
        action_dim = math.prod(spec.action.shape)
        target_entropy = config.target_entropy if config.target_entropy is not None else -float(action_dim)
        critic = TwinCritic(spec, net_config, tuple(hidden))
        self.nets = SACNetworks(make_actor(spec, net_config), critic, config.init_alpha, target_entropy).to(
            device
        )
        self._opts: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}

    @property
    def actor(self) -> nn.Module:
        return self.nets.actor

    def modules(self) -> dict[str, nn.Module]:
        return {"sac": self.nets}

    def shard(self, world: Any) -> None:
        from trainer.distributed import shard

        # The actor is its own FSDP unit so it can be gathered alone for publication.
        shard(self.nets.actor, world, ("sample", "distribution"))
        shard(self.nets, world)

    def build_optimizers(self) -> None:
        c, n = self.config, self.nets
        groups = [
            {"params": list(n.actor.parameters()), "lr": c.actor_lr},
            {"params": list(n.critic.parameters()), "lr": c.critic_lr},
            {"params": [n.log_alpha], "lr": c.alpha_lr},
        ]
        self._opts = {"sac": (n, torch.optim.Adam(groups))}

    def optimizers(self) -> dict[str, tuple[nn.Module, torch.optim.Optimizer]]:
        return self._opts

    def update(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        c, n = self.config, self.nets
        out = n(batch, c.gamma)
        opt = self._opts["sac"][1]
        opt.zero_grad(set_to_none=True)
        # Every rank runs every backward (FSDP's collectives must match); a non-finite
        # loss on any rank makes the reduced gradient norms non-finite on all of them,
        # and that is where they all agree to skip the step.
        (out["critic"] + out["actor"] + out["alpha"]).backward()
        groups = [list(n.critic.parameters()), list(n.actor.parameters()), [n.log_alpha]]
        if not all(clip_groups(groups, c.max_grad_norm)):
            self.skipped_updates += 1
            return {"skipped": 1.0}
        opt.step()
        soft_update(n.target, n.critic, c.tau)
        return {
            "skipped": 0.0,
            "loss/critic": float(out["critic"].detach()),
            "loss/actor": float(out["actor"].detach()),
            "alpha": float(out["alpha_value"]),
            "q": float(out["q"]),
            "entropy": float(out["entropy"]),
        }
