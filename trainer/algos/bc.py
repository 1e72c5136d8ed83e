"""Behaviour cloning: supervised fine-tuning of the actor on demonstrations.

Batches need only ``obs/*`` and ``action`` (e.g. from a ``demos`` table filled with
episodes of a scripted controller or a teleoperator). ``loss: nll`` maximises the
log-likelihood of the demonstrated action under the actor's tanh-Gaussian (so the
stochastic policy's spread shrinks where demonstrations agree); ``loss: mse`` regresses
the deterministic action.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gateway.episode import EnvSpec
from networks.modules import make_actor
from trainer.algos import Algorithm
from trainer.algos.common import clip_and_check
from trainer.algos.options import BCConfig

_EDGE = 1e-4  # keeps atanh finite for demonstrated actions on the bounds


class BehaviourCloning(Algorithm):
    Config = BCConfig
    needs_next_obs = False

    def __init__(self, spec: EnvSpec, net_config: Any, config: BCConfig, *, device: torch.device) -> None:
        super().__init__(spec, net_config, config, device=device)
        self._actor = make_actor(spec, net_config).to(device)
        self._opts: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}

    @property
    def actor(self) -> nn.Module:
        return self._actor

    def modules(self) -> dict[str, nn.Module]:
        return {"actor": self._actor}

    def build_optimizers(self) -> None:
        self._opts = {"actor": (self._actor, torch.optim.Adam(self._actor.parameters(), lr=self.config.lr))}

    def optimizers(self) -> dict[str, tuple[nn.Module, torch.optim.Optimizer]]:
        return self._opts

    def update(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        obs = {k[4:]: v for k, v in batch.items() if k.startswith("obs/")}
        action = batch["action"].float().flatten(1)
        actor = self._actor
        if self.config.loss == "mse":
            zeros = torch.zeros_like(action)
            loss = (actor(obs, zeros).flatten(1) - action).pow(2).sum(1).mean()
        else:
            mean, log_std = actor.distribution(obs)
            unit = ((action - actor.action_mid) / actor.action_half).clamp(-1 + _EDGE, 1 - _EDGE)
            eps = (torch.atanh(unit) - mean) / torch.exp(log_std)
            _, log_prob = actor.sample(obs, eps)
            loss = -log_prob.mean()
        opt = self._opts["actor"][1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if not clip_and_check(actor, self.config.max_grad_norm):
            self.skipped_updates += 1
            return {"skipped": 1.0}
        opt.step()
        return {"skipped": 0.0, "loss/bc": float(loss.detach())}
