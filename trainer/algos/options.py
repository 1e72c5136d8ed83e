"""Every algorithm's options and experiment checks, without torch.

``loopgate up`` validates ``trainer.options`` (and refuses an experiment the algorithm
cannot train) before it starts anything; importing torch for that took over a second
of every start, before the first service was launched. The algorithms themselves
(:mod:`trainer.algos.sac`, ...) take their ``Config`` from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from gateway.config import ConfigError


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


@dataclass(frozen=True, kw_only=True)
class BCConfig:
    """Options of behaviour cloning (``trainer.options`` with ``trainer.algorithm: bc``)."""

    lr: float = 1e-3
    """Adam learning rate."""
    loss: Literal["nll", "mse"] = "nll"
    """Negative log-likelihood of the demonstrated action, or MSE of the deterministic one."""
    max_grad_norm: float = 10.0
    """Gradient clipping norm."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"trainer.options.lr must be > 0, got {self.lr}")
        if self.loss not in ("nll", "mse"):
            raise ValueError(f"trainer.options.loss must be 'nll' or 'mse', got {self.loss!r}")


@dataclass(frozen=True, kw_only=True)
class PPOConfig:
    """Options of PPO (``trainer.options`` with ``trainer.algorithm: ppo``)."""

    gamma: float = 0.99
    """Discount per step; must equal the rollout table's ``gamma`` (the items carry it)."""
    gae_lambda: float = 0.95
    """GAE's λ: 0 is one-step TD, 1 the Monte-Carlo return."""
    clip: float = 0.2
    """Clip range ε of the probability ratio."""
    value_clip: float | None = 0.2
    """Clip range of the value update around the old value (None: plain squared error)."""
    epochs: int = 5
    """Passes over each rollout."""
    minibatches: int = 4
    """Minibatches per pass (each split evenly over the trainer processes)."""
    lr: float = 1e-3
    """Adam learning rate (the starting one with ``schedule: adaptive``)."""
    schedule: Literal["fixed", "adaptive"] = "adaptive"
    """``adaptive``: divide the rate by 1.5 when the KL passes 2 × ``desired_kl``, multiply below half of it."""
    desired_kl: float = 0.01
    """Target KL per minibatch of the adaptive schedule."""
    entropy_coef: float = 0.005
    """Weight of the entropy bonus."""
    value_coef: float = 1.0
    """Weight of the value loss."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm (actor and critic together)."""
    normalize_advantages: bool = True
    """Normalise advantages over the rollout (zero mean, unit std)."""
    rollout_steps: int | None = None
    """Steps per env per rollout (rsl_rl's ``num_steps_per_env``); when set, ``trainer.collect_steps`` must be this × every env."""
    critic_hidden: tuple[int, ...] | None = None
    """Critic MLP widths; default the actor's ``hidden_sizes``."""

    def __post_init__(self) -> None:
        if not 0 < self.gamma <= 1:
            raise ValueError(f"trainer.options.gamma must be in (0, 1], got {self.gamma}")
        if not 0 <= self.gae_lambda <= 1:
            raise ValueError(f"trainer.options.gae_lambda must be in [0, 1], got {self.gae_lambda}")
        if not 0 < self.clip < 1:
            raise ValueError(f"trainer.options.clip must be in (0, 1), got {self.clip}")
        if self.value_clip is not None and self.value_clip <= 0:
            raise ValueError(f"trainer.options.value_clip must be > 0 or null, got {self.value_clip}")
        for name in ("epochs", "minibatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.options.{name} must be >= 1, got {getattr(self, name)}")
        if self.rollout_steps is not None and self.rollout_steps < 1:
            raise ValueError(f"trainer.options.rollout_steps must be >= 1 or null, got {self.rollout_steps}")
        for name in ("lr", "desired_kl", "max_grad_norm"):
            if getattr(self, name) <= 0:
                raise ValueError(f"trainer.options.{name} must be > 0, got {getattr(self, name)}")
        for name in ("entropy_coef", "value_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"trainer.options.{name} must be >= 0, got {getattr(self, name)}")
        if self.schedule not in ("fixed", "adaptive"):
            raise ValueError(f"trainer.options.schedule must be 'fixed' or 'adaptive', got {self.schedule!r}")


def check_ppo_experiment(cfg: Any, options: PPOConfig) -> None:
    """PPO needs sync rounds and one queue table that hands out each step once, linked."""
    tc = cfg.trainer
    if tc.mode != "sync":
        raise ConfigError(
            f"trainer.algorithm ppo is on-policy and needs trainer.mode: sync (got {tc.mode!r}): "
            "collect a rollout with the current version, train, publish"
        )
    if len(tc.tables) != 1:
        raise ConfigError(
            f"trainer.algorithm ppo trains on one rollout table, trainer.tables names {sorted(tc.tables)}"
        )
    name = next(iter(tc.tables))
    i, table = next((i, t) for i, t in enumerate(cfg.replay.tables) if t.name == name)
    where = f"replay.tables[{i}]"
    want = {
        "item": "transition",
        "sampler": "fifo",
        "max_times_sampled": 1,
        "links": True,
        "samples_per_insert": None,
        "source": "online",
    }
    for key, value in want.items():
        if getattr(table, key) != value:
            raise ConfigError(
                f"{where}.{key} must be {value!r} for ppo's rollout table (got {getattr(table, key)!r}): "
                "every step of a round is handed to the trainer once, with the links GAE follows"
            )
    if table.max_size < tc.collect_steps:
        raise ConfigError(
            f"{where}.max_size ({table.max_size}) must hold a whole round, trainer.collect_steps ({tc.collect_steps})"
        )
    envs = cfg.env.workers * cfg.env.num_envs
    if options.rollout_steps is not None and tc.collect_steps != options.rollout_steps * envs:
        raise ConfigError(
            f"trainer.collect_steps ({tc.collect_steps}) must be trainer.options.rollout_steps "
            f"({options.rollout_steps}) × env.workers × env.num_envs ({envs}) = {options.rollout_steps * envs}"
        )
    if tc.collect_steps < options.minibatches * tc.nproc:
        raise ConfigError(
            f"trainer.collect_steps ({tc.collect_steps}) leaves no step for some of the "
            f"{options.minibatches} minibatches × {tc.nproc} processes"
        )
