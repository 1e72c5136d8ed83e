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
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gateway.episode import EnvSpec
from trainer.algos import Algorithm
from trainer.algos.common import average_grad, clip_and_check, soft_update
from trainer.networks import make_actor, make_encoder, mlp


@dataclass(frozen=True, kw_only=True)
class SACConfig:
    """Options of SAC (``trainer.options`` with ``trainer.algorithm: sac``)."""

    gamma: float = 0.95
    """Discount per step (n-step items bring their own ``discount``)."""
    tau: float = 0.005
    """Polyak rate of the target critics."""
    actor_lr: float = 3e-4
    """Adam learning rate of the actor."""
    critic_lr: float = 3e-4
    """Adam learning rate of the critics."""
    alpha_lr: float = 3e-4
    """Adam learning rate of the temperature."""
    init_alpha: float = 1.0
    """Initial entropy temperature."""
    target_entropy: float | None = None
    """Entropy the temperature aims for; default ``-action_dim``."""
    critic_hidden: tuple[int, ...] | None = None
    """Critic MLP widths; default the actor's ``hidden_sizes``."""
    max_grad_norm: float = 10.0
    """Gradient clipping norm for actor and critics."""

    def __post_init__(self) -> None:
        if not 0 < self.gamma <= 1:
            raise ValueError(f"trainer.options.gamma must be in (0, 1], got {self.gamma}")
        if not 0 < self.tau <= 1:
            raise ValueError(f"trainer.options.tau must be in (0, 1], got {self.tau}")
        for name in ("actor_lr", "critic_lr", "alpha_lr", "init_alpha", "max_grad_norm"):
            if getattr(self, name) <= 0:
                raise ValueError(f"trainer.options.{name} must be > 0, got {getattr(self, name)}")


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


class SAC(Algorithm):
    Config = SACConfig

    def __init__(self, spec: EnvSpec, net_config: Any, config: SACConfig, *, device: torch.device) -> None:
        super().__init__(spec, net_config, config, device=device)
        hidden = config.critic_hidden or net_config.hidden_sizes
        self._actor = make_actor(spec, net_config).to(device)
        self.critic = TwinCritic(spec, net_config, tuple(hidden)).to(device)
        self.target = copy.deepcopy(self.critic)
        self.target.requires_grad_(False)
        self.log_alpha = torch.tensor([math.log(config.init_alpha)], device=device, requires_grad=True)
        action_dim = math.prod(spec.action.shape)
        self.target_entropy = (
            config.target_entropy if config.target_entropy is not None else -float(action_dim)
        )
        self._opts: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}

    @property
    def actor(self) -> nn.Module:
        return self._actor

    def modules(self) -> dict[str, nn.Module]:
        return {"actor": self._actor, "critic": self.critic, "target": self.target}

    def build_optimizers(self) -> None:
        c = self.config
        self._opts = {
            "actor": (self._actor, torch.optim.Adam(self._actor.parameters(), lr=c.actor_lr)),
            "critic": (self.critic, torch.optim.Adam(self.critic.parameters(), lr=c.critic_lr)),
        }
        self.alpha_opt = torch.optim.Adam([self.log_alpha], lr=c.alpha_lr)

    def optimizers(self) -> dict[str, tuple[nn.Module, torch.optim.Optimizer]]:
        return self._opts

    def update(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        c = self.config
        obs = {k[4:]: v for k, v in batch.items() if k.startswith("obs/")}
        next_obs = {k[9:]: v for k, v in batch.items() if k.startswith("next_obs/")}
        action, reward = batch["action"], batch["reward"].float()
        not_done = 1.0 - batch["terminated"].float()
        discount = batch["discount"].float() if "discount" in batch else torch.full_like(reward, c.gamma)
        alpha = self.log_alpha.exp().detach()
        with torch.no_grad():
            next_action, next_logp = self._actor.sample(next_obs)
            tq1, tq2 = self.target(next_obs, next_action)
            target_q = reward + discount * not_done * (torch.min(tq1, tq2) - alpha * next_logp)
        q1, q2 = self.critic(obs, action)
        critic_loss = 0.5 * ((q1 - target_q).pow(2).mean() + (q2 - target_q).pow(2).mean())
        # Every rank runs every backward (FSDP's collectives must match); a non-finite
        # loss on any rank makes the reduced gradient norm non-finite on all of them,
        # and that is where they all agree to skip the step.
        critic_opt, actor_opt = self._opts["critic"][1], self._opts["actor"][1]
        critic_opt.zero_grad(set_to_none=True)
        critic_loss.backward()
        if not clip_and_check(self.critic, c.max_grad_norm):
            self.skipped_updates += 1
            return {"skipped": 1.0}
        critic_opt.step()
        # The actor's loss flows through the critic too; those critic gradients are
        # discarded (zeroed before the critic's next step), as in the reference SAC.
        new_action, logp = self._actor.sample(obs)
        pq1, pq2 = self.critic(obs, new_action)
        actor_loss = (alpha * logp - torch.min(pq1, pq2)).mean()
        alpha_loss = -(self.log_alpha * (logp.detach() + self.target_entropy)).mean()
        actor_opt.zero_grad(set_to_none=True)
        self.alpha_opt.zero_grad(set_to_none=True)
        (actor_loss + alpha_loss).backward()
        average_grad(self.log_alpha)
        alpha_ok = self.log_alpha.grad is not None and bool(torch.isfinite(self.log_alpha.grad).all())
        if not (clip_and_check(self._actor, c.max_grad_norm) and alpha_ok):
            self.skipped_updates += 1
            return {"skipped": 1.0, "loss/critic": float(critic_loss.detach())}
        actor_opt.step()
        self.alpha_opt.step()
        soft_update(self.target, self.critic, c.tau)
        return {
            "skipped": 0.0,
            "loss/critic": float(critic_loss.detach()),
            "loss/actor": float(actor_loss.detach()),
            "alpha": float(alpha),
            "q": float(q1.detach().mean()),
            "entropy": float(-logp.detach().mean()),
        }

    def extra_state(self) -> dict[str, torch.Tensor]:
        return {"log_alpha": self.log_alpha.detach().clone()}

    def load_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        if "log_alpha" in state:
            with torch.no_grad():
                self.log_alpha.copy_(state["log_alpha"])
