"""Any registered Gymnasium environment as a loopgate episode backend.

The ``gymnasium`` backend runs one env (``num_envs: 1``) or gymnasium's own sync or
async vector env, always with same-step autoreset, and reports an :class:`EnvSpec`
derived from the spaces::

    env:
      backend: gymnasium
      num_envs: 4
      options: {id: Pendulum-v1, vectorization: async}

Spaces map to specs as follows. A ``Box`` (or ``Discrete``, ``MultiDiscrete``,
``MultiBinary``) observation becomes the single key ``obs``; a ``Dict`` of those keeps
its keys. ``Discrete(n, start)`` actions become int64 scalars with bounds
``[start, start + n - 1]``; ``MultiDiscrete`` int64 arrays likewise; ``MultiBinary`` int8
in [0, 1]; ``Box`` actions keep dtype, shape and bounds, and unbounded dimensions keep
their ``-inf``/``inf`` bounds (the spec says what the env accepts; a policy that samples
the action range must bound those dimensions itself). Other spaces (``Tuple``, ``Text``,
``Graph``, nested ``Dict``) are refused with an error naming the env and the space.

``info`` carries the env's own numeric info entries with a leading env dim (for envs
that finished, the entries of their last step, not of the reset), and on steps where
any env finished, ``final_obs`` in loopgate's dict-of-arrays form; for envs that did not
finish it equals ``obs``. Ids of the form ``module:Env-v0`` import ``module`` first, and
``loopgate/...`` ids are available without an import.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import gymnasium
import numpy as np
import numpy.typing as npt
from gymnasium import spaces
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv

from gateway.episode import ActionSpec, ArraySpec, EnvSpec, EpisodeBackend, Info, Obs, StepResult
from gateway.episode import AutoresetMode as LoopgateAutoreset
from gateway.registry import import_user_module, missing_package, user_module_missing

logger = logging.getLogger(__name__)

OBS_KEY = "obs"
"""The observation key of envs whose observation space is not a ``Dict``."""
_NAMESPACE_MODULES = {"loopgate": "sim_bridges.mujoco"}
"""Modules that register a namespace's ids, imported on demand."""


def find_env_spec(env_id: str) -> gymnasium.envs.registration.EnvSpec:
    """The registered gymnasium spec of ``env_id``; ValueError naming ``env.options.id`` if unknown."""
    module, _, name = env_id.rpartition(":")
    namespace = name.split("/")[0] if "/" in name else None
    try:
        if module:
            import_user_module(module)
        elif namespace in _NAMESPACE_MODULES:
            importlib.import_module(_NAMESPACE_MODULES[namespace])
        return gymnasium.spec(name)
    except ImportError as exc:
        why = user_module_missing(module, exc) if module else missing_package(exc)
        raise ValueError(f"env.options.id {env_id!r} cannot be imported: {why}") from exc
    except gymnasium.error.Error as exc:
        raise ValueError(f"env.options.id: unknown Gymnasium id {env_id!r}: {exc}") from exc


@dataclass(frozen=True, kw_only=True)
class GymnasiumBackendConfig:
    """Options of the ``gymnasium`` backend (``env.options``)."""

    id: str
    """Registered Gymnasium id, e.g. ``CartPole-v1`` or ``module:Env-v0``."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for ``gymnasium.make``'s env constructor."""
    vectorization: Literal["sync", "async"] = "sync"
    """With ``num_envs`` > 1: one process (``sync``) or a process per env (``async``); ignored for one env."""
    start_method: Literal["fork", "spawn", "forkserver"] | None = None
    """How ``async`` starts its processes (``None``: the platform default); ``spawn`` for envs that misbehave when forked."""
    control_hz: float | None = None
    """Control rate for the spec; default: the env's ``metadata["render_fps"]``."""
    max_episode_steps: int | None = None
    """Episode limit (applied with gymnasium's ``TimeLimit``); default: the registered one."""
    success_key: str | None = None
    """The info key that says the task succeeded (e.g. ``is_success`` of Gymnasium-Robotics);
    None: the key the env declares in ``metadata["success_key"]``, if any; an env with
    neither has no success signal, and its success rates are reported as unknown."""

    def __post_init__(self) -> None:
        if not self.id:
            raise ValueError("env.options.id must name a Gymnasium env, got ''")
        if self.vectorization not in ("sync", "async"):
            raise ValueError(
                f"env.options.vectorization must be 'sync' or 'async', got {self.vectorization!r}"
            )
        if self.control_hz is not None and not self.control_hz > 0:
            raise ValueError(f"env.options.control_hz must be > 0, got {self.control_hz!r}")
        if self.max_episode_steps is not None and self.max_episode_steps < 1:
            raise ValueError(f"env.options.max_episode_steps must be >= 1, got {self.max_episode_steps!r}")
        # Fails at config load rather than when a worker starts.
        find_env_spec(self.id)


# ------------------------------------------------------------------ space -> spec


def _array_spec(space: spaces.Space[Any], env_id: str, what: str) -> ArraySpec:
    if isinstance(space, spaces.Box):
        return ArraySpec(dtype=space.dtype.name, shape=space.shape)
    if isinstance(space, spaces.Discrete):
        return ArraySpec(dtype="int64", shape=())
    if isinstance(space, spaces.MultiDiscrete):
        return ArraySpec(dtype="int64", shape=space.shape)
    if isinstance(space, spaces.MultiBinary):
        return ArraySpec(dtype="int8", shape=space.shape)
    raise ValueError(
        f"{env_id}: {what} space {space} is not supported (Box, Discrete, MultiDiscrete, MultiBinary)"
    )


def observation_specs(space: spaces.Space[Any], env_id: str) -> dict[str, ArraySpec]:
    """Observation arrays of a gymnasium observation space (see the module docstring)."""
    if isinstance(space, spaces.Dict):
        # A nested Dict or a Tuple inside falls through to _array_spec's refusal.
        return {
            str(key): _array_spec(sub, env_id, f"observation {key!r}") for key, sub in space.spaces.items()
        }
    return {OBS_KEY: _array_spec(space, env_id, "observation")}


def action_spec(space: spaces.Space[Any], env_id: str) -> ActionSpec:
    """The :class:`ActionSpec` of a gymnasium action space (see the module docstring)."""
    if isinstance(space, spaces.Box):
        return ActionSpec(
            dtype=space.dtype.name,
            shape=space.shape,
            low=tuple(space.low.astype(np.float64).ravel()),
            high=tuple(space.high.astype(np.float64).ravel()),
        )
    if isinstance(space, spaces.Discrete):
        start = float(space.start)
        return ActionSpec(dtype="int64", shape=(), low=(start,), high=(start + float(space.n) - 1,))
    if isinstance(space, spaces.MultiDiscrete):
        first = space.start.astype(np.float64).ravel()
        return ActionSpec(
            dtype="int64",
            shape=space.shape,
            low=tuple(first),
            high=tuple(first + space.nvec.astype(np.float64).ravel() - 1),
        )
    if isinstance(space, spaces.MultiBinary):
        size = int(np.prod(space.shape))
        return ActionSpec(dtype="int8", shape=space.shape, low=(0.0,) * size, high=(1.0,) * size)
    raise ValueError(
        f"{env_id}: action space {space} is not supported (Box, Discrete, MultiDiscrete, MultiBinary)"
    )


# ------------------------------------------------------------------------ backend


class GymnasiumBackend(EpisodeBackend):
    """A registered Gymnasium env (or gymnasium vector env) behind the episode interface."""

    Config = GymnasiumBackendConfig
    autoreset_mode = LoopgateAutoreset.SAME_STEP

    def __init__(self, config: GymnasiumBackendConfig, *, num_envs: int, seed: int = 0) -> None:
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        self.config = config
        self.num_envs = num_envs
        self._seed: int | None = seed
        env_spec = find_env_spec(config.id)
        if config.max_episode_steps is not None:
            env_spec = dataclasses.replace(env_spec, max_episode_steps=config.max_episode_steps)
        make_one = functools.partial(gymnasium.make, env_spec, **config.kwargs)
        self._env: Any
        if num_envs == 1:
            self._env = make_one()
            obs_space, act_space = self._env.observation_space, self._env.action_space
        else:
            fns = [make_one] * num_envs
            if config.vectorization == "sync":
                self._env = SyncVectorEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP)
            else:
                self._env = AsyncVectorEnv(
                    fns, autoreset_mode=AutoresetMode.SAME_STEP, context=config.start_method
                )
            obs_space, act_space = self._env.single_observation_space, self._env.single_action_space
        self.success_key: str | None = config.success_key or self._env.metadata.get("success_key")
        try:
            self.spec = self._make_spec(env_spec, obs_space, act_space)
        except ValueError:
            self._env.close()
            raise
        self._obs_dtypes = {key: np.dtype(s.dtype) for key, s in self.spec.observation.items()}

    def _make_spec(
        self, env_spec: Any, obs_space: spaces.Space[Any], act_space: spaces.Space[Any]
    ) -> EnvSpec:
        env_id = self.config.id
        observation = observation_specs(obs_space, env_id)
        action = action_spec(act_space, env_id)
        control_hz = self.config.control_hz or self._env.metadata.get("render_fps")
        if not control_hz:
            raise ValueError(
                f"env.options.control_hz: {env_id} has no metadata['render_fps']; set a control rate"
            )
        max_steps = env_spec.max_episode_steps
        if max_steps is None:
            raise ValueError(f"env.options.max_episode_steps: {env_id} registers no episode limit; set one")
        try:
            return EnvSpec(
                name=env_id,
                observation=observation,
                action=action,
                control_hz=float(control_hz),
                max_episode_steps=int(max_steps),
                metadata={"gymnasium_id": env_id, "success_signal": self.success_key is not None},
            )
        except ValueError as exc:
            if str(exc).startswith(env_id):
                raise
            raise ValueError(f"{env_id}: {exc}") from exc

    # ------------------------------------------------------------ conversions

    def _batch_obs(self, obs: Any) -> Obs:
        """Gymnasium observations (one env's, or a vector env's batch) as loopgate's dict."""
        single = self.num_envs == 1
        items = obs.items() if isinstance(obs, Mapping) else [(OBS_KEY, obs)]
        out: Obs = {}
        for key, value in items:
            arr = np.asarray(value, dtype=self._obs_dtypes[key])
            out[key] = arr[None].copy() if single else arr.copy()
        return out

    def _final_obs(self, obs: Obs, info: Mapping[str, Any]) -> Obs:
        """Gymnasium's ``final_obs`` (an object array of single-env observations) merged into a copy of ``obs``."""
        final = {key: value.copy() for key, value in obs.items()}
        mask = np.asarray(info.get("_final_obs", np.zeros(self.num_envs, bool)))
        for i in np.flatnonzero(mask):
            last = info["final_obs"][i]
            for key, value in last.items() if isinstance(last, Mapping) else [(OBS_KEY, last)]:
                final[key][i] = value
        return final

    def _numeric_info(self, info: Mapping[str, Any]) -> Info:
        """The env's numeric info entries with a leading env dim."""
        out: Info = {}
        single = self.num_envs == 1
        for key, value in info.items():
            if key.startswith("_") or key in ("final_obs", "final_info"):
                continue
            arr = np.asarray(value)
            if arr.dtype.kind not in "biuf":
                continue
            if single:
                out[key] = arr[None]
            elif arr.shape[:1] == (self.num_envs,):
                out[key] = arr.copy()
        key = self.success_key
        if key is not None and key in out:
            out["success"] = out[key].astype(bool)
        final_info = info.get("final_info")
        if isinstance(final_info, Mapping):
            # For envs that finished, report their last step, not the reset.
            for key, value in self._numeric_info(final_info).items():
                mask = np.asarray(final_info.get(f"_{key}", np.zeros(self.num_envs, bool)))
                if key in out and out[key].shape == value.shape:
                    out[key][mask] = value[mask]
                else:
                    out.setdefault(key, value)
        return out

    def _env_action(self, action: npt.NDArray[Any]) -> Any:
        if self.num_envs > 1:
            return action
        if isinstance(self._env.action_space, spaces.Discrete):
            return int(action[0])
        return action[0]

    # --------------------------------------------------------------- interface

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Obs, Info]:
        if self._env is None:
            raise RuntimeError(f"gymnasium backend for {self.config.id} is closed")
        if seed is None:
            # The constructor's seed applies to the first reset unless a seed is given.
            seed, self._seed = self._seed, None
        else:
            self._seed = None
        obs, info = self._env.reset(seed=seed, options=options)
        return self._batch_obs(obs), self._numeric_info(info)

    def step(self, action: npt.NDArray[Any]) -> StepResult:
        if self._env is None:
            raise RuntimeError(f"gymnasium backend for {self.config.id} is closed")
        action = np.asarray(action)
        problems = self.spec.check_action(action, self.num_envs)
        if problems:
            raise ValueError(f"{self.config.id}: {'; '.join(problems)}")
        if self.num_envs == 1:
            return self._step_single(action)
        raw_obs, reward, terminated, truncated, raw_info = self._env.step(action)
        obs = self._batch_obs(raw_obs)
        info = self._numeric_info(raw_info)
        if "final_obs" in raw_info:
            info["final_obs"] = self._final_obs(obs, raw_info)
        return (
            obs,
            np.asarray(reward, dtype=np.float32),
            np.asarray(terminated, dtype=bool),
            np.asarray(truncated, dtype=bool),
            info,
        )

    def _step_single(self, action: npt.NDArray[Any]) -> StepResult:
        raw_obs, reward, terminated, truncated, raw_info = self._env.step(self._env_action(action))
        obs = self._batch_obs(raw_obs)
        info = self._numeric_info(raw_info)
        if terminated or truncated:
            info["final_obs"] = obs
            reset_obs, _ = self._env.reset()
            obs = self._batch_obs(reset_obs)
        return (
            obs,
            np.array([reward], dtype=np.float32),
            np.array([terminated], dtype=bool),
            np.array([truncated], dtype=bool),
            info,
        )

    def close(self) -> None:
        env, self._env = getattr(self, "_env", None), None
        if env is not None:
            env.close()
