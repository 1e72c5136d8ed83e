"""Learning algorithms: one small module each, one registry, one interface.

An algorithm owns its networks and optimizers and turns batches from the replay service
into updates::

    algo = make_algorithm("sac", spec, net_config, options, device=device)
    algo.shard(mp_policy)            # FSDP2 over its networks, then its optimizers
    for batch in batches:
        stats = algo.update(batch)   # {"loss/critic": ..., "skipped": 0.0, ...}
    publish(algo.actor)              # the policy the inference servers serve

Adding one is a new module in this folder, its options' dataclass in
:mod:`trainer.algos.options` and one line in :data:`ALGORITHMS`; an on-policy one (PPO)
subclasses :class:`OnPolicyAlgorithm` and trains on whole rollouts.

This module and :mod:`trainer.algos.options` import no torch: ``loopgate up`` checks a
config against the registry before it starts anything.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from gateway.config import ConfigError, build
from trainer.algos.options import BCConfig, PPOConfig, SACConfig, check_ppo_experiment

if TYPE_CHECKING:
    import torch
    from torch import nn

    from gateway.episode import EnvSpec


@dataclass(frozen=True)
class Registered:
    """One algorithm: where its class is, and what checks a config without importing it."""

    algorithm: str
    """``module:Class`` of the :class:`Algorithm` (imported, with torch, only to train)."""
    options: type
    """Frozen dataclass of its options (``trainer.options``)."""
    check: Callable[[Any, Any], None] | None = None
    """``check(cfg, options)`` raises ``ConfigError`` for an experiment it cannot train."""


ALGORITHMS: dict[str, Registered] = {
    "sac": Registered("trainer.algos.sac:SAC", SACConfig),
    "bc": Registered("trainer.algos.bc:BehaviourCloning", BCConfig),
    "ppo": Registered("trainer.algos.ppo:PPO", PPOConfig, check_ppo_experiment),
}
"""Algorithms by the name ``trainer.algorithm`` uses."""


def registered(name: str) -> Registered:
    """The registry's entry for ``name``; a ``ConfigError`` naming the known ones if none."""
    entry = ALGORITHMS.get(name)
    if entry is None:
        raise ConfigError(
            f"trainer.algorithm: unknown algorithm {name!r}; known: {', '.join(sorted(ALGORITHMS))}"
        )
    return entry


class Algorithm(abc.ABC):
    """Networks + optimizers + the update rule."""

    needs_next_obs: ClassVar[bool] = True
    """Whether batches must carry ``next_obs/*`` (TD learning) or not (cloning)."""

    def __init__(self, spec: EnvSpec, net_config: Any, config: Any, *, device: torch.device) -> None:
        self.spec, self.net_config, self.config, self.device = spec, net_config, config, device
        self.skipped_updates = 0

    @property
    @abc.abstractmethod
    def actor(self) -> nn.Module:
        """The policy network whose weights are published."""

    @abc.abstractmethod
    def modules(self) -> dict[str, nn.Module]:
        """Every trained network by name (sharded, checkpointed)."""

    @abc.abstractmethod
    def optimizers(self) -> dict[str, tuple[nn.Module, torch.optim.Optimizer]]:
        """Every optimizer by name, with the module whose parameters it steps."""

    @abc.abstractmethod
    def build_optimizers(self) -> None:
        """Create optimizers (after sharding, so they hold the sharded parameters)."""

    @abc.abstractmethod
    def update(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One gradient step on ``batch``; non-finite losses skip the step (``skipped``: 1)."""

    def shard(self, world: Any) -> None:
        """Wrap the networks with FSDP2 (before :meth:`build_optimizers`).

        The default shards each of :meth:`modules` on its own, registering the actor's
        ``sample`` and ``distribution`` as entry points; algorithms whose update is one
        forward of one module (SAC) do better with a single unit.
        """
        from trainer.distributed import shard

        for name, module in self.modules().items():
            shard(module, world, ("sample", "distribution") if name == "actor" else ())

    def extra_state(self) -> dict[str, torch.Tensor]:
        """Tensors besides modules and optimizers to checkpoint (e.g. SAC's temperature)."""
        return {}

    def load_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        return None


class OnPolicyAlgorithm(Algorithm):
    """Trains on whole rollouts of the current policy version (``trainer.mode: sync``).

    Each round the trainer hands :meth:`learn` every step of the round that acted with
    the version its parameters are, then publishes the next version."""

    @abc.abstractmethod
    def learn(self, rollout: dict[str, torch.Tensor]) -> dict[str, float]:
        """All updates of one round; statistics, with ``updates`` (gradient steps taken)."""

    def min_rollout(self) -> int:
        """Fewest steps :meth:`learn` can train on (a smaller round is collected again)."""
        return 1


def make_algorithm(
    name: str, spec: EnvSpec, net_config: Any, options: dict[str, Any], *, device: torch.device
) -> Algorithm:
    """Build the algorithm registered as ``name`` with validated options."""
    entry = registered(name)
    module_name, _, attr = entry.algorithm.partition(":")
    cls: type[Algorithm] = getattr(importlib.import_module(module_name), attr)
    config = build(entry.options, options, "trainer.options")
    return cls(spec, net_config, config, device=device)
