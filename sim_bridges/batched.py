"""Batched torch simulators with Isaac Lab's env API, behind loopgate's episode interface.

Isaac Lab (``ManagerBasedRLEnv``), mjlab (``ManagerBasedRlEnv``) and loopgate's own torch
simulators step thousands of envs in one process with torch tensors. This module is the
one code path they share; :mod:`sim_bridges.isaac` and :mod:`sim_bridges.mjlab` only build
the env and hand it here. Any object of this shape works::

    env.num_envs                  # int
    env.device                    # "cpu", "cuda:0", a torch.device
    env.step_dt                   # seconds per step (physics dt * decimation)
    env.max_episode_length        # steps; the env times out after that many
    env.single_observation_space  # gymnasium Dict of groups: a Box, or a Dict of Boxes (terms)
    env.single_action_space       # gymnasium Box
    env.reset(seed=None, options=None) -> (obs, extras)
    env.step(action: torch.Tensor) -> (obs, reward, terminated, time_outs, extras)
    env.close()

Wrap it (or a gymnasium wrapper around it: ``env.unwrapped`` is used for the attributes)::

    backend = TorchEnvBackend(env, name="Isaac-Reach-Franka-v0", groups={"policy": "policy"}, seed=0)
    obs, info = backend.reset()           # {"policy": f32[N, 32]} as numpy
    obs, reward, terminated, truncated, info = backend.step(actions)   # numpy in, numpy out

What it maps, and why:

- **Observation groups.** ``obs`` is a dict of groups; a group is one tensor (its terms
  concatenated) or a dict of term tensors. A tensor group becomes the observation key the
  ``groups`` mapping gives it, a term ``t`` of a dict group ``g`` the key ``"g.t"``. The
  mapping also renames: mjlab calls Isaac Lab's ``policy`` group ``actor``
  (``groups={"actor": "policy", "critic": "critic"}``), so networks and configs see the
  same keys from both. Groups left out of the mapping are not sent.
- **Tensors to numpy without needless copies.** A CUDA tensor comes to the host once
  (``.cpu()``, which is the copy). On the CPU a tensor group is handed out as a numpy view
  of the env's own tensor: both simulators build each group anew every step (``torch.cat``
  of the terms). A backend that refills its group tensor in place is caught (the tensor
  handed out last step is kept alive, so the same address again means reuse, not the
  allocator) and copied from then on, with a warning. Term dicts, rewards and the two flag
  tensors are copied: terms can be views of simulator state, and ``reward``,
  ``terminated`` and ``time_outs`` are buffers the env modifies in place on its next
  step; a copy is also what makes them safe to hand to another thread or process.
- **Same-step autoreset without a terminal observation.** Envs that finish are reset
  inside ``step``; the observation returned for a done env is the first one of its next
  episode, and the last one of the old episode is returned nowhere. So
  :attr:`provides_final_obs` is False and ``info["final_obs"]`` is never set: the reset
  observation is never stored as the old episode's terminal state.
- **time_outs are truncations** (the value of the next state still counts: bootstrap),
  ``terminated`` are terminations. Both can be true for one env in one step.
- **extras["log"]** (episode statistics of the envs that reset) is rebuilt only on steps
  where some env reset; on other steps Isaac Lab leaves the previous dict in place. It is
  forwarded as ``info["log"]`` (names to floats) only on steps with a reset, and after
  :meth:`reset`.
- **Checks.** Every returned tensor must have ``num_envs`` rows, live on the env's device
  and have the spec's dtype (observations), float32 (reward) or bool (flags); anything else
  is a :class:`ValueError` that names the tensor, what it is and what was expected. Actions
  are checked against the spec before they reach the simulator and move to its device.
- **Action bounds.** Isaac Lab's action spaces are unbounded; ``clip_actions=c`` makes
  the spec's bounds ``[-c, c]`` and clamps actions to them (rsl_rl's wrapper option).

The constructor reads everything the spec needs from the env's spaces, so the spec is
readable before the first reset. Seeding is per batch (Isaac Lab seeds one generator for
all envs): ``reset(seed=s)`` seeds the env with ``s``; the first reset without a seed uses
the constructor's ``seed``.
"""

from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Mapping
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

log = logging.getLogger(__name__)

_BOOL, _F32 = np.dtype(np.bool_), np.dtype(np.float32)


def check_options(
    *,
    simulator: str,
    task: str,
    example: str,
    device: str,
    groups: Mapping[str, str],
    max_episode_steps: int | None,
    clip_actions: float | None,
) -> None:
    """The option checks every adapter's config shares (``ValueError`` naming the option)."""
    if not task:
        raise ValueError(f"env.options.task must name an {simulator} task, e.g. {example!r}")
    if not (device == "cpu" or device.startswith("cuda")):
        raise ValueError(f"env.options.device must be 'cpu' or 'cuda[:N]', got {device!r}")
    if not groups or not all(isinstance(k, str) and isinstance(v, str) for k, v in groups.items()):
        raise ValueError(f"env.options.groups must map group names to keys, got {groups!r}")
    if max_episode_steps is not None and max_episode_steps < 1:
        raise ValueError(f"env.options.max_episode_steps must be >= 1, got {max_episode_steps}")
    if clip_actions is not None and not clip_actions > 0:
        raise ValueError(f"env.options.clip_actions must be > 0, got {clip_actions}")


def _numpy_dtype(tensor: Any) -> np.dtype[Any]:
    """The numpy dtype of a torch tensor (``torch.float32`` -> ``float32``)."""
    return np.dtype(str(tensor.dtype).removeprefix("torch."))


def _box(space: Any, where: str) -> ArraySpec:
    shape, dtype = getattr(space, "shape", None), getattr(space, "dtype", None)
    if shape is None or dtype is None:
        raise ValueError(f"{where}: expected a gymnasium Box, got {type(space).__name__}")
    return ArraySpec(dtype=np.dtype(dtype).name, shape=tuple(int(d) for d in shape))


def _subspaces(space: Any) -> Mapping[str, Any] | None:
    """The members of a gymnasium ``Dict`` space (None when ``space`` is not one)."""
    spaces = getattr(space, "spaces", None)
    return spaces if isinstance(spaces, Mapping) else None


def _same_device(have: Any, want: Any) -> bool:
    """Whether two torch devices are the same (``cuda`` and ``cuda:0`` are, on device 0)."""
    if have.type != want.type:
        return False
    return have.index is None or want.index is None or have.index == want.index


class TorchEnvBackend(EpisodeBackend):
    """An env with Isaac Lab's ``ManagerBasedRLEnv`` shape as an episode backend (see the module docstring)."""

    autoreset_mode = AutoresetMode.SAME_STEP
    provides_final_obs = False

    def __init__(
        self,
        env: Any,
        *,
        name: str,
        groups: Mapping[str, str] | None = None,
        seed: int | None = 0,
        clip_actions: float | None = None,
        metadata: Mapping[str, Any] | None = None,
        owns_env: bool = True,
    ) -> None:
        """Wrap ``env``; ``groups`` maps the env's observation groups to loopgate keys (None: all, unrenamed).

        ``clip_actions`` bounds the action to ``[-clip, clip]`` (the spec says so, and actions
        are clamped before they reach the env, as rsl_rl's Isaac Lab wrapper does): Isaac Lab's
        action spaces are unbounded. With ``owns_env``, :meth:`close` closes the env too.
        """
        if clip_actions is not None and not clip_actions > 0:
            raise ValueError(f"clip_actions must be > 0, got {clip_actions}")
        self.clip_actions = clip_actions
        self._torch = importlib.import_module("torch")
        self.env = env
        self.raw = getattr(env, "unwrapped", env)
        self._owns_env = owns_env
        self._closed = False
        self.num_envs = int(self.raw.num_envs)
        if self.num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {self.num_envs}")
        self.device = self._torch.device(self.raw.device)
        self._seed = seed
        self._seeded = False
        obs_space = _subspaces(self.raw.single_observation_space)
        if obs_space is None:
            raise ValueError(
                "env.single_observation_space must be a Dict of observation groups, got "
                f"{type(self.raw.single_observation_space).__name__}"
            )
        if groups is None:
            groups = {g: g for g in obs_space}
        missing = [g for g in groups if g not in obs_space]
        if missing:
            raise ValueError(
                f"observation groups {missing} are not in the env; it has {sorted(obs_space)} "
                "(env.options.groups maps env groups to observation keys)"
            )
        self.groups: dict[str, str] = dict(groups)
        """Env group -> loopgate key (the key prefix of a dict group's terms)."""
        self._terms: dict[str, tuple[str, ...] | None] = {}
        observation: dict[str, ArraySpec] = {}
        for group, key in self.groups.items():
            space = obs_space[group]
            terms = _subspaces(space)
            if terms is None:
                self._terms[group] = None
                observation[key] = _box(space, f"observation group {group!r}")
            else:
                self._terms[group] = tuple(terms)
                for term, sub in terms.items():
                    observation[f"{key}.{term}"] = _box(sub, f"observation term {group}.{term}")
        act = self.raw.single_action_space
        act_spec = _box(act, "env.single_action_space")
        low = np.broadcast_to(np.asarray(getattr(act, "low", -math.inf), np.float64), act_spec.shape)
        high = np.broadcast_to(np.asarray(getattr(act, "high", math.inf), np.float64), act_spec.shape)
        if clip_actions is not None:
            low, high = np.maximum(low, -clip_actions), np.minimum(high, clip_actions)
        step_dt = float(self.raw.step_dt)
        self.spec = EnvSpec(
            name=name,
            observation=observation,
            action=ActionSpec(
                dtype=act_spec.dtype,
                shape=act_spec.shape,
                low=tuple(low.ravel().tolist()),
                high=tuple(high.ravel().tolist()),
            ),
            control_hz=1.0 / step_dt,
            max_episode_steps=int(self.raw.max_episode_length),
            metadata={
                "obs_groups": dict(self.groups),
                "device": str(self.device),
                "final_obs": False,
                **(metadata or {}),
            },
        )
        self.observation_device = str(self.device)
        self._device_obs: dict[str, Any] | None = None
        """The last observations as the env's tensors (:meth:`device_observations`)."""
        self._held: dict[str, Any] = {}
        """Tensor groups handed out last time as views: kept alive so that reuse is detectable."""
        self._copy_groups: set[str] = set()
        """Groups the env was seen refilling in place: copied from then on."""

    # ------------------------------------------------------------------ tensors

    def _check(self, tensor: Any, what: str, dtype: np.dtype[Any], tail: tuple[int, ...]) -> np.dtype[Any]:
        if not isinstance(tensor, self._torch.Tensor):
            raise ValueError(f"{what} is a {type(tensor).__name__}, expected a torch tensor")
        shape = tuple(tensor.shape)
        want = (self.num_envs, *tail)
        if shape[:1] != want[:1]:
            raise ValueError(
                f"{what} has leading dimension {shape[:1] or '()'} ({list(shape)}), expected num_envs={self.num_envs}"
            )
        if shape != want:
            raise ValueError(f"{what} has shape {list(shape)}, expected {list(want)}")
        if not _same_device(tensor.device, self.device):
            raise ValueError(f"{what} is on {tensor.device}, expected the env's device {self.device}")
        have = _numpy_dtype(tensor)
        if have != dtype:
            raise ValueError(f"{what} is {have.name}, expected {dtype.name}")
        return have

    def _to_numpy(self, tensor: Any, *, copy: bool) -> npt.NDArray[Any]:
        """A host numpy array of ``tensor``: a view on the CPU unless ``copy``."""
        tensor = tensor.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()  # the device-to-host transfer is the one copy
            copy = False
        array = np.asarray(tensor.numpy())
        if copy or not array.flags.c_contiguous:  # frames go out without copies: C order only
            return np.array(array, order="C", copy=True)
        return array

    def _observations(self, obs: Any) -> Obs:
        if not isinstance(obs, Mapping):
            raise ValueError(f"observations are a {type(obs).__name__}, expected a dict of groups")
        out: Obs = {}
        held: dict[str, Any] = {}
        tensors: dict[str, Any] = {}
        for group, key in self.groups.items():
            if group not in obs:
                raise ValueError(f"observation group {group!r} is missing; the env returned {sorted(obs)}")
            value, terms = obs[group], self._terms[group]
            if terms is None:
                spec = self.spec.observation[key]
                self._check(value, f"observation group {group!r}", spec.np_dtype, spec.shape)
                out[key] = self._group_array(group, value)
                tensors[key] = value.detach()
                if value.device.type == "cpu" and group not in self._copy_groups:
                    held[group] = value
                continue
            if not isinstance(value, Mapping):
                raise ValueError(
                    f"observation group {group!r} is a {type(value).__name__}, expected a dict of terms"
                )
            for term in terms:
                if term not in value:
                    raise ValueError(
                        f"observation term {group}.{term} is missing; the group has {sorted(value)}"
                    )
                spec = self.spec.observation[f"{key}.{term}"]
                self._check(value[term], f"observation term {group}.{term}", spec.np_dtype, spec.shape)
                out[f"{key}.{term}"] = self._to_numpy(value[term], copy=True)
                tensors[f"{key}.{term}"] = value[term].detach()
        self._held = held
        self._device_obs = tensors
        return out

    def device_observations(self) -> dict[str, Any] | None:
        """The last observations as the env's own tensors (keys as in :meth:`reset`): the
        worker copies them into its CUDA IPC ring before the env steps again."""
        return self._device_obs

    def _group_array(self, group: str, tensor: Any) -> npt.NDArray[Any]:
        if tensor.device.type == "cpu" and group not in self._copy_groups:
            last = self._held.get(group)
            if last is not None and last.data_ptr() == tensor.data_ptr():
                log.warning(
                    "observation group %r: the env refilled the tensor it returned last step; "
                    "copying this group from now on",
                    group,
                )
                self._copy_groups.add(group)
        return self._to_numpy(tensor, copy=group in self._copy_groups)

    @staticmethod
    def _log(extras: Any) -> dict[str, float]:
        """``extras["log"]`` as names to floats (scalar tensors and numbers; others are skipped)."""
        raw = extras.get("log") if isinstance(extras, Mapping) else None
        out: dict[str, float] = {}
        if not isinstance(raw, Mapping):
            return out
        for name, value in raw.items():
            numel = getattr(value, "numel", None)
            if numel is not None:
                if numel() == 1:
                    out[str(name)] = float(value.item())
            elif isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
                out[str(name)] = float(value)
        return out

    # -------------------------------------------------------------- interface

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Obs, Info]:
        self._require_open()
        if seed is None and not self._seeded:
            seed = self._seed
        self._seeded = True
        obs, extras = self.env.reset(seed=seed, options=options)
        self._held = {}
        info: Info = {}
        stats = self._log(extras)
        if stats:
            info["log"] = stats
        return self._observations(obs), info

    def step(self, action: npt.NDArray[Any]) -> StepResult:
        self._require_open()
        action = np.asarray(action)
        problems = self.spec.check_action(action, self.num_envs)
        if problems:
            raise ValueError("action: " + "; ".join(problems))
        tensor = self._torch.from_numpy(np.ascontiguousarray(action))
        if self.clip_actions is not None:
            tensor = tensor.clamp(-self.clip_actions, self.clip_actions)
        if not _same_device(tensor.device, self.device):
            tensor = tensor.to(self.device, non_blocking=False)
        obs, reward, terminated, time_outs, extras = self.env.step(tensor)
        self._check(reward, "reward", _F32, ())
        self._check(terminated, "terminated", _BOOL, ())
        self._check(time_outs, "time_outs", _BOOL, ())
        out = self._observations(obs)
        rew = self._to_numpy(reward, copy=True)
        term = self._to_numpy(terminated, copy=True)
        trunc = self._to_numpy(time_outs, copy=True)
        info: Info = {}
        if term.any() or trunc.any():
            stats = self._log(extras)
            if stats:
                info["log"] = stats
        return out, rew, term, trunc, info

    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"backend {self.spec.name!r} is closed")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._held = {}
        self._device_obs = None
        if self._owns_env:
            self.env.close()
