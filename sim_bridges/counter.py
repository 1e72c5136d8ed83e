"""A tiny deterministic backend with no simulator: for smoke runs and in-process tests.

Each env counts: the observation is ``{"count": f32[1]}`` (steps since the episode
began) and ``{"signal": f32[2]}`` (the last action, clipped); the reward is minus the
action's distance to a fixed target, an episode succeeds and terminates when the action
is within ``success_radius`` of it, and is truncated after ``max_episode_steps``::

    env:
      backend: counter
      num_envs: 4
      options: {max_episode_steps: 20}

It needs nothing beyond numpy, so a gateway, a worker or a whole ``loopgate up`` can be
exercised in milliseconds per step on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from gateway.episode import (
    ActionSpec,
    ArraySpec,
    AutoresetMode,
    EnvSpec,
    EpisodeBackend,
    Info,
    Obs,
    StepResult,
)

TARGET = np.array([0.5, -0.25], np.float32)


@dataclass(frozen=True, kw_only=True)
class CounterConfig:
    """Options of the ``counter`` backend (``env.options``)."""

    max_episode_steps: int = 20
    """Steps after which an episode is truncated."""
    success_radius: float = 0.05
    """An action this close to the target succeeds (and terminates the episode)."""
    control_hz: float = 100.0
    """Control rate the spec declares."""

    def __post_init__(self) -> None:
        if self.max_episode_steps < 1:
            raise ValueError(f"env.options.max_episode_steps must be >= 1, got {self.max_episode_steps}")
        if self.success_radius < 0:
            raise ValueError(f"env.options.success_radius must be >= 0, got {self.success_radius}")
        if not self.control_hz > 0:
            raise ValueError(f"env.options.control_hz must be > 0, got {self.control_hz}")


class CounterBackend(EpisodeBackend):
    """``num_envs`` counters behind the episode interface (same-step autoreset)."""

    Config = CounterConfig
    autoreset_mode = AutoresetMode.SAME_STEP

    def __init__(self, config: CounterConfig, *, num_envs: int, seed: int = 0) -> None:
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        self.config, self.num_envs = config, num_envs
        self.spec = self.spec_for(config)
        self._count = np.zeros(num_envs, np.int64)
        self._signal = np.zeros((num_envs, 2), np.float32)

    @classmethod
    def spec_for(cls, config: CounterConfig) -> EnvSpec:
        return EnvSpec(
            name="counter",
            observation={
                "count": ArraySpec(dtype="float32", shape=(1,)),
                "signal": ArraySpec(dtype="float32", shape=(2,)),
            },
            action=ActionSpec(dtype="float32", shape=(2,), low=(-1.0, -1.0), high=(1.0, 1.0)),
            control_hz=config.control_hz,
            max_episode_steps=config.max_episode_steps,
            metadata={"success_signal": True, "target": TARGET.tolist()},
        )

    def _obs(self, rows: npt.NDArray[np.bool_] | None = None) -> Obs:
        count, signal = self._count[:, None].astype(np.float32), self._signal.copy()
        if rows is None:
            return {"count": count, "signal": signal}
        return {"count": count[rows], "signal": signal[rows]}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Obs, Info]:
        self._count[:] = 0
        self._signal[:] = 0.0
        return self._obs(), {}

    def step(self, action: npt.NDArray[Any]) -> StepResult:
        problems = self.spec.check_action(np.asarray(action), self.num_envs)
        if problems:
            raise ValueError("action: " + "; ".join(problems))
        self._signal = np.clip(action, -1.0, 1.0)
        self._count += 1
        distance = np.linalg.norm(self._signal - TARGET, axis=1).astype(np.float32)
        success = distance <= self.config.success_radius
        terminated = success.copy()
        truncated = ~terminated & (self._count >= self.config.max_episode_steps)
        info: Info = {"success": success, "distance": distance}
        done = terminated | truncated
        if done.any():
            info["final_obs"] = self._obs()
            self._count[done] = 0
            self._signal[done] = 0.0
        return self._obs(), -distance, terminated, truncated, info
