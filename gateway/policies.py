"""Policies the gateway can run in-process, and the interface they share.

A policy maps a batch of observations to a batch of actions and says which weights
produced them (``version``; scripted policies are version 0)::

    policy = make_policy("reach_pd", spec, seed=0)
    action = policy.act(obs)            # (num_envs, *spec.action.shape), spec.action.dtype

Scripted policies let collection run before any learned policy exists and collect
baseline demonstrations. Task-specific ones live beside their task
(``sim_bridges.reach:ReachPDPolicy``); the registry is ``gateway.registry.POLICIES``.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from gateway.episode import EnvSpec, Obs
from gateway.steps import filled


class Policy(abc.ABC):
    """Batch of observations -> batch of actions."""

    Config: ClassVar[type | None] = None
    """Frozen dataclass validating the policy's options (``policy.options``)."""
    version: int = 0
    """Version of the weights behind the actions; scripted policies are 0."""
    deterministic: bool = True
    """Whether actions depend only on observations."""

    def __init__(self, spec: EnvSpec, config: Any = None, *, seed: int = 0) -> None:
        self.spec = spec
        self.config = config
        self.seed = seed

    @abc.abstractmethod
    def act(self, obs: Obs) -> np.ndarray:
        """Actions for a batch of observations (leading env dimension)."""


@dataclass(frozen=True, kw_only=True)
class RandomPolicyConfig:
    """Options of the random policy."""

    scale: float = 1.0
    """Fraction of the action range to sample from, centred on its middle."""

    def __post_init__(self) -> None:
        if not 0 < self.scale <= 1:
            raise ValueError(f"policy.options.scale must be in (0, 1], got {self.scale}")


class RandomPolicy(Policy):
    """Uniform actions within the spec's bounds (integers for discrete actions)."""

    Config = RandomPolicyConfig
    deterministic = False

    def __init__(self, spec: EnvSpec, config: RandomPolicyConfig | None = None, *, seed: int = 0) -> None:
        super().__init__(spec, config or RandomPolicyConfig(), seed=seed)
        self._rng = np.random.default_rng(seed)
        low, high = (
            spec.action.low_array.astype(np.float64),
            spec.action.high_array.astype(np.float64),
        )
        if not (np.isfinite(low).all() and np.isfinite(high).all()):
            raise ValueError(
                f"policy random: {spec.name}'s action bounds are not finite (low {spec.action.low}, "
                f"high {spec.action.high}); bound the actions in the env (for Isaac Lab and mjlab "
                "envs: env.options.clip_actions) or use another policy"
            )
        mid, half = (low + high) / 2, (high - low) / 2 * self.config.scale
        self._low, self._high = mid - half, mid + half
        self._range = self._high - self._low

    def act(self, obs: Obs) -> np.ndarray:
        n = len(next(iter(obs.values())))
        shape = (n, *self.spec.action.shape)
        sample: np.ndarray
        if self.spec.action.discrete:
            sample = self._rng.integers(
                self._low.astype(np.int64), self._high.astype(np.int64) + 1, size=shape
            )
        else:
            # What ``uniform(low, high, size)`` computes, value for value, without its
            # broadcasting of array bounds (a third of the cost of a small batch).
            sample = self._low + self._range * self._rng.random(shape)
        return sample.astype(self.spec.action.dtype)


class ZeroPolicy(Policy):
    """The middle of the action range: holds a position-controlled robot still."""

    def act(self, obs: Obs) -> np.ndarray:
        n = len(next(iter(obs.values())))
        mid = (self.spec.action.low_array.astype(np.float64) + self.spec.action.high_array) / 2
        out: np.ndarray = np.broadcast_to(
            mid.astype(self.spec.action.dtype), (n, *self.spec.action.shape)
        ).copy()
        return out


def make_policy(kind: str, spec: EnvSpec, options: dict[str, Any] | None = None, *, seed: int = 0) -> Policy:
    """Build the in-process policy registered as ``kind`` with validated options."""
    from gateway.factory import build
    from gateway.registry import POLICIES, resolve

    cls: type[Policy] = resolve(POLICIES, kind, "policy")
    if cls.Config is None:
        if options:
            raise ValueError(f"policy.options: policy {kind!r} takes no options, got {sorted(options)}")
        return cls(spec, seed=seed)
    return cls(spec, build(cls.Config, options or {}, "policy.options"), seed=seed)


class ActionSource(abc.ABC):
    """Where the gateway gets actions: in-process policies or remote inference servers.

    The gateway submits a batch of observations with a key and a deadline and later
    collects ``(key, actions, policy_versions, error)``; a source that answers at once
    (in-process) and one that answers over sockets (inference servers) look the same.
    """

    synchronous: bool = False
    """Whether :meth:`submit` has the answer ready before it returns (in-process policies)."""
    takes_device_obs: bool = False
    """Whether :meth:`submit` can use ``device_obs`` (inference servers on a worker's GPU)."""

    @abc.abstractmethod
    def submit(
        self,
        key: Any,
        obs: Obs,
        deadline: float,
        deterministic: np.ndarray | None = None,
        device_obs: dict[str, Any] | None = None,
    ) -> None:
        """Ask for actions for ``obs``; ``deadline`` is on the ``time.monotonic`` clock.

        ``deterministic`` (bool per row) asks for the policy's deterministic action on
        those rows (evaluation episodes); sources without a stochastic mode ignore it.
        ``device_obs`` is a CUDA IPC handle of the same observations on the worker's GPU
        (:mod:`gateway.cuda_ipc`), given only to sources that ``takes_device_obs``.
        """

    @abc.abstractmethod
    def results(self) -> list[tuple[Any, np.ndarray | None, np.ndarray | None, str | None]]:
        """Answers since the last call: ``(key, actions, versions, error message)``."""

    def sockets(self) -> list[Any]:
        """ZeroMQ sockets the gateway's poller should watch."""
        return []

    def tick(self) -> None:
        """Periodic work (retries, health checks)."""
        return None

    @property
    def version(self) -> int:
        """Newest policy version this source serves."""
        return 0

    def describe(self) -> dict[str, Any]:
        return {"kind": type(self).__name__}

    def close(self) -> None:
        return None


class InProcessSource(ActionSource):
    """Runs a :class:`Policy` in the gateway process; answers immediately."""

    synchronous = True

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._done: list[tuple[Any, np.ndarray | None, np.ndarray | None, str | None]] = []

    def submit(
        self,
        key: Any,
        obs: Obs,
        deadline: float,
        deterministic: np.ndarray | None = None,
        device_obs: dict[str, Any] | None = None,
    ) -> None:
        late = time.monotonic() - deadline
        if late > 0:  # as an inference server would: no actions the caller no longer waits for
            self._done.append((key, None, None, f"deadline passed {late:.3f} s before the policy ran"))
            return
        # Scripted policies have one mode; RandomPolicy is random by design, also in evaluation.
        actions = self.policy.act(obs)
        n = len(actions)
        self._done.append((key, actions, filled(n, self.policy.version, np.int64), None))

    def results(self) -> list[tuple[Any, np.ndarray | None, np.ndarray | None, str | None]]:
        done, self._done = self._done, []
        return done

    @property
    def version(self) -> int:
        return self.policy.version

    def describe(self) -> dict[str, Any]:
        return {"kind": "in_process", "policy": type(self.policy).__name__, "version": self.policy.version}
