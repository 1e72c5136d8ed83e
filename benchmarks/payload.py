"""A synthetic episode backend whose observation is one array of a chosen byte size.

It isolates the data path from any simulator: stepping costs one ``np.full`` (a fresh
array every step, as a camera would deliver), so what a benchmark measures around it
is the worker, the wire and the gateway. Episodes truncate every
``max_episode_steps`` steps with Gymnasium's same-step autoreset, so the gateway's
episode-end path (final observations, chunk flushes) is part of the measurement::

    backend = PayloadBackend(nbytes=4096)           # obs {"payload": u8[1, 4096]}
    obs, info = backend.reset(seed=0)
    obs, reward, terminated, truncated, info = backend.step(np.zeros((1, 3), np.float32))
"""

from __future__ import annotations

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

TASK_NAME = "bench_payload"
PAYLOAD_KEY = "payload"


def payload_spec(nbytes: int, *, dtype: str = "uint8", max_episode_steps: int = 100) -> EnvSpec:
    """The spec of a :class:`PayloadBackend` (also what the gateway is started with)."""
    itemsize = np.dtype(dtype).itemsize
    if nbytes < itemsize or nbytes % itemsize:
        raise ValueError(f"nbytes must be a positive multiple of {itemsize} for {dtype}, got {nbytes}")
    return EnvSpec(
        name=TASK_NAME,
        observation={PAYLOAD_KEY: ArraySpec(dtype=dtype, shape=(nbytes // itemsize,))},
        action=ActionSpec(dtype="float32", shape=(3,), low=(-1.0,) * 3, high=(1.0,) * 3),
        control_hz=1000.0,
        max_episode_steps=max_episode_steps,
        metadata={"purpose": "benchmark payload"},
    )


class PayloadBackend(EpisodeBackend):
    """``num_envs`` envs emitting one ``nbytes`` observation array each per step."""

    autoreset_mode = AutoresetMode.SAME_STEP

    def __init__(
        self, nbytes: int, *, num_envs: int = 1, dtype: str = "uint8", max_episode_steps: int = 100
    ) -> None:
        self.spec = payload_spec(nbytes, dtype=dtype, max_episode_steps=max_episode_steps)
        self.num_envs = num_envs
        self._shape = (num_envs, *self.spec.observation[PAYLOAD_KEY].shape)
        self._dtype = np.dtype(dtype)
        self._steps = np.zeros(num_envs, dtype=np.int64)
        self._tick = 0

    def _obs(self) -> Obs:
        self._tick += 1
        return {PAYLOAD_KEY: np.full(self._shape, self._tick % 251, dtype=self._dtype)}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Obs, Info]:
        self._steps[:] = 0
        return self._obs(), {"success": np.zeros(self.num_envs, bool)}

    def step(self, action: npt.NDArray[Any]) -> StepResult:
        self._steps += 1
        obs = self._obs()
        truncated = self._steps >= self.spec.max_episode_steps
        terminated = np.zeros(self.num_envs, bool)
        info: Info = {"success": np.zeros(self.num_envs, bool)}
        if truncated.any():
            info["final_obs"] = obs
            obs = {PAYLOAD_KEY: obs[PAYLOAD_KEY].copy()}
            obs[PAYLOAD_KEY][truncated] = self._obs()[PAYLOAD_KEY][truncated]
            self._steps[truncated] = 0
        reward = np.zeros(self.num_envs, np.float32)
        return obs, reward, terminated, truncated, info
