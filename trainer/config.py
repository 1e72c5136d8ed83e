"""The ``trainer:`` config block."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.config import ConfigError


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """The FSDP trainer: algorithm, processes, pacing, publication, checkpoints, evaluation."""

    enabled: bool = False
    """Start the trainer with ``loopgate up``."""
    algorithm: str = "sac"
    """``sac``, ``bc`` or ``ppo`` (see ``trainer.algos.ALGORITHMS``)."""
    options: dict[str, Any] = field(default_factory=dict)
    """The algorithm's options (e.g. ``gamma`` for SAC)."""
    nproc: int = 1
    """Trainer processes on this machine (``torchrun --nproc_per_node``); FSDP shards over them."""
    min_nproc: int | None = None
    """Ray engine: the fewest ranks the trainer may (re)start with when its placement group
    of ``nproc`` ranks finds no room (a lost node, a smaller spare): it resumes from its last
    checkpoint, resharded, at the size that fits. None: always ``nproc``."""
    shrink_after_s: float = 30.0
    """Ray engine, with ``min_nproc``: how long a placement group may wait for room before
    one rank fewer is asked for."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto``: CUDA (NCCL, bf16 mixed precision) when available, else CPU (gloo)."""
    threads: int = 1
    """torch intra-op threads per process (CPU): keep nproc * threads <= cores."""
    batch_size: int = 256
    """Global batch per update, split evenly over the processes."""
    tables: dict[str, float] = field(default_factory=lambda: {"online": 1.0})
    """Replay tables to sample from and their fractions of each batch (e.g. online 0.5, demos 0.5)."""
    prefetch: int = 4
    """Sample requests kept in flight per process."""
    sample_timeout_s: float = 120.0
    """Give up on one sample request (and retry) after this long."""
    mode: Literal["sync", "async", "disaggregated"] = "async"
    """``sync``: collect, train, publish, repeat; ``async``: collection never waits for training."""
    collect_steps: int = 2000
    """sync: env steps collected per round."""
    updates_per_round: int = 500
    """sync: updates per round."""
    max_policy_lag: int | None = 8
    """async: pause collection while the acting policy is this many versions behind (None: never)."""
    publish_every: int = 50
    """Publish a new policy version every this many updates."""
    checkpoint_every: int = 1000
    """Save a checkpoint every this many updates (and at the end)."""
    eval_every: int = 1000
    """Ask the gateway for evaluation episodes every this many updates (0: never)."""
    eval_episodes: int = 16
    """Episodes per periodic evaluation (deterministic policy, never trained on)."""
    final_eval_episodes: int = 50
    """Episodes of the final evaluation when the trainer finishes."""
    max_updates: int | None = None
    """Stop after this many updates (None: until the run's step budget or Ctrl-C)."""
    target_success_rate: float | None = None
    """Stop early once ``target_rounds`` periodic evaluations in a row reach this success rate."""
    target_rounds: int = 2
    """Consecutive evaluation rounds at or above ``target_success_rate`` needed to stop."""
    init_timeout_s: float = 60.0
    """Timeout of the process group's collectives: a lost peer fails fast instead of hanging."""
    seed: int = 0
    """Seed of network initialisation and sampling noise."""

    def world_sizes(self) -> list[int]:
        """The trainer's world sizes to try, largest first: ``nproc`` down to ``min_nproc``."""
        return list(range(self.nproc, (self.min_nproc or self.nproc) - 1, -1))

    def __post_init__(self) -> None:
        checks = [
            ("nproc", self.nproc >= 1, ">= 1"),
            ("threads", self.threads >= 1, ">= 1"),
            ("batch_size", self.batch_size >= 1, ">= 1"),
            ("prefetch", self.prefetch >= 1, ">= 1"),
            ("collect_steps", self.collect_steps >= 1, ">= 1"),
            ("updates_per_round", self.updates_per_round >= 1, ">= 1"),
            ("publish_every", self.publish_every >= 1, ">= 1"),
            ("checkpoint_every", self.checkpoint_every >= 1, ">= 1"),
            ("eval_every", self.eval_every >= 0, ">= 0 (0: no periodic evaluation)"),
            ("eval_episodes", self.eval_episodes >= 1, ">= 1"),
            ("target_rounds", self.target_rounds >= 1, ">= 1"),
            ("final_eval_episodes", self.final_eval_episodes >= 0, ">= 0 (0: no final evaluation)"),
            ("init_timeout_s", self.init_timeout_s > 0, "> 0"),
            ("sample_timeout_s", self.sample_timeout_s > 0, "> 0"),
            ("shrink_after_s", self.shrink_after_s > 0, "> 0"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ConfigError(f"trainer.{name} must be {rule}, got {getattr(self, name)!r}")
        if self.batch_size % self.nproc:
            raise ConfigError(
                f"trainer.batch_size ({self.batch_size}) must divide evenly over trainer.nproc ({self.nproc})"
            )
        if self.min_nproc is not None:
            if not 1 <= self.min_nproc <= self.nproc:
                raise ConfigError(
                    f"trainer.min_nproc must be between 1 and trainer.nproc ({self.nproc}), got {self.min_nproc}"
                )
            uneven = [n for n in self.world_sizes() if self.batch_size % n]
            if uneven:
                raise ConfigError(
                    f"trainer.batch_size ({self.batch_size}) must divide evenly over every world size "
                    f"from trainer.min_nproc to trainer.nproc; it does not over {uneven[0]}"
                )
        if not self.tables or any(v <= 0 for v in self.tables.values()):
            raise ConfigError(f"trainer.tables must map table names to positive fractions, got {self.tables}")
        if self.max_policy_lag is not None and self.max_policy_lag < 1:
            raise ConfigError(f"trainer.max_policy_lag must be >= 1 or null, got {self.max_policy_lag}")
        if self.max_updates is not None and self.max_updates < 1:
            raise ConfigError(f"trainer.max_updates must be >= 1 or null, got {self.max_updates}")
        if self.target_success_rate is not None and not 0 < self.target_success_rate <= 1:
            raise ConfigError(
                f"trainer.target_success_rate must be in (0, 1], got {self.target_success_rate}"
            )
