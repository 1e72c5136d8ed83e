"""The episode interface: what every robot and simulator looks like to loopgate.

An :class:`EnvSpec` says what an environment produces and accepts before anything
connects; an :class:`EpisodeBackend` is a batch of ``num_envs`` such environments with
Gymnasium semantics and a leading env dimension on every array::

    backend = make_backend("mujoco_reach", num_envs=4, seed=0)
    obs, info = backend.reset(seed=0)            # obs: {"joint_pos": f32[4, 3], ...}
    while collecting:
        action = policy(obs)                     # f32[4, *spec.action.shape]
        obs, reward, terminated, truncated, info = backend.step(action)
        # finished envs were reset already (AutoresetMode.SAME_STEP): `obs` holds the
        # first observation of their next episode, info["final_obs"] the last one of
        # the episode that ended, valid where terminated | truncated.
    backend.close()

``info`` maps names to arrays with the leading env dimension (``"success"``: bool) and,
for backends with ``SAME_STEP`` autoreset, on steps where some episode ended,
``"final_obs"``: a dict of observation arrays (rows of envs that did not finish are
meaningless), unless the backend declares ``provides_final_obs = False`` (its simulator
keeps no terminal observation). Arrays a backend returns belong to the caller: the backend must not
refill them on a later step (the worker sends them without copying). Everything in
loopgate adapts to these semantics; backends adapt their simulator or robot to them,
never the reverse.
"""

from __future__ import annotations

import abc
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any

import numpy as np
import numpy.typing as npt

from gateway.protocol.codec import ALLOWED_DTYPES

Obs = dict[str, npt.NDArray[Any]]
Info = dict[str, Any]
StepResult = tuple[Obs, npt.NDArray[np.float32], npt.NDArray[np.bool_], npt.NDArray[np.bool_], Info]


class AutoresetMode(str, Enum):
    """When a batched backend resets a finished env. loopgate speaks one of Gymnasium's
    three modes, ``SAME_STEP``: a backend over a simulator with another mode adapts it
    (as the ``gymnasium`` backend builds its vector envs with ``SAME_STEP``)."""

    SAME_STEP = "same_step"
    """The last step returns the reset observation; the final one is in info."""


def _check_dtype(where: str, dtype: str) -> None:
    if dtype not in ALLOWED_DTYPES:
        raise ValueError(f"{where}.dtype must be one of {sorted(ALLOWED_DTYPES)}, got {dtype!r}")


def _check_shape(where: str, shape: tuple[int, ...]) -> None:
    if not isinstance(shape, tuple) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"{where}.shape must be a tuple of non-negative ints, got {shape!r}")


@dataclass(frozen=True, kw_only=True)
class ArraySpec:
    """One observation array of a single env (no env dimension)."""

    dtype: str
    """Numpy dtype name, e.g. ``"float32"`` or ``"uint8"``."""
    shape: tuple[int, ...]
    """Shape of one env's array."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        _check_dtype("observation", self.dtype)
        _check_shape("observation", self.shape)

    @functools.cached_property
    def np_dtype(self) -> np.dtype[Any]:
        """The dtype as a numpy object (comparing these is much cheaper than names)."""
        return np.dtype(self.dtype)

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ArraySpec:
        return cls(dtype=str(data["dtype"]), shape=tuple(int(d) for d in data["shape"]))


@dataclass(frozen=True, kw_only=True)
class ActionSpec:
    """The action of a single env: dtype, shape and per-element bounds."""

    dtype: str
    """Numpy dtype name (``float32`` for continuous control, ``int64`` for discrete)."""
    shape: tuple[int, ...]
    """Shape of one env's action."""
    low: tuple[float, ...]
    """Lower bound per element (flattened, C order); a single number is broadcast."""
    high: tuple[float, ...]
    """Upper bound per element (flattened, C order); a single number is broadcast."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        size = math.prod(self.shape)
        for name in ("low", "high"):
            value = getattr(self, name)
            if isinstance(value, (int, float)):
                value = (float(value),) * size
            object.__setattr__(self, name, tuple(float(v) for v in value))
        _check_dtype("action", self.dtype)
        _check_shape("action", self.shape)
        if len(self.low) != size or len(self.high) != size:
            raise ValueError(f"action.low/high must have {size} elements for shape {self.shape}")
        if any(lo > hi for lo, hi in zip(self.low, self.high)):
            raise ValueError(f"action.low must be <= action.high, got {self.low} > {self.high}")

    @property
    def low_array(self) -> npt.NDArray[Any]:
        return np.asarray(self.low, dtype=self.dtype).reshape(self.shape)

    @property
    def high_array(self) -> npt.NDArray[Any]:
        return np.asarray(self.high, dtype=self.dtype).reshape(self.shape)

    @functools.cached_property
    def bounds(self) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        """(low, high) as float64 arrays of the action's shape, made once (an integer
        action's bound may be infinite)."""
        return tuple(np.asarray(b, dtype=np.float64).reshape(self.shape) for b in (self.low, self.high))  # type: ignore[return-value]

    @functools.cached_property
    def np_dtype(self) -> np.dtype[Any]:
        """The dtype as a numpy object (comparing these is much cheaper than names)."""
        return np.dtype(self.dtype)

    @property
    def discrete(self) -> bool:
        return np.dtype(self.dtype).kind in "iu"

    def to_dict(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "low": list(self.low),
            "high": list(self.high),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ActionSpec:
        return cls(
            dtype=str(data["dtype"]),
            shape=tuple(int(d) for d in data["shape"]),
            low=tuple(float(v) for v in data["low"]),
            high=tuple(float(v) for v in data["high"]),
        )


@dataclass(frozen=True, kw_only=True)
class EnvSpec:
    """What an environment produces and accepts; compared when a worker registers."""

    name: str
    """Task name, e.g. ``"reach"``; part of the comparison."""
    observation: Mapping[str, ArraySpec]
    """Observation arrays by key."""
    action: ActionSpec
    """The action."""
    control_hz: float
    """Control rate the task is designed for (steps per second of robot time)."""
    max_episode_steps: int
    """Steps after which an episode is truncated."""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """Free-form facts (e.g. success radius); not compared."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("spec.name must not be empty")
        if not self.observation:
            raise ValueError("spec.observation must have at least one key")
        for key in self.observation:
            if not key or "/" in key:
                raise ValueError(f"spec.observation key {key!r} must be non-empty and contain no '/'")
        object.__setattr__(self, "observation", MappingProxyType(dict(self.observation)))
        object.__setattr__(self, "metadata", MappingProxyType(dict(self.metadata)))
        if not (self.control_hz > 0):
            raise ValueError(f"spec.control_hz must be > 0, got {self.control_hz}")
        if self.max_episode_steps <= 0:
            raise ValueError(f"spec.max_episode_steps must be > 0, got {self.max_episode_steps}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "observation": {k: v.to_dict() for k, v in self.observation.items()},
            "action": self.action.to_dict(),
            "control_hz": self.control_hz,
            "max_episode_steps": self.max_episode_steps,
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EnvSpec:
        try:
            return cls(
                name=str(data["name"]),
                observation={str(k): ArraySpec.from_dict(v) for k, v in data["observation"].items()},
                action=ActionSpec.from_dict(data["action"]),
                control_hz=float(data["control_hz"]),
                max_episode_steps=int(data["max_episode_steps"]),
                metadata=dict(data.get("metadata", {})),
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"malformed env spec: {exc!r}") from exc

    def mismatches(self, other: EnvSpec) -> list[str]:
        """Human-readable differences that make ``other`` incompatible with this spec."""
        problems: list[str] = []
        if self.name != other.name:
            problems.append(f"task name {other.name!r} != {self.name!r}")
        for key in sorted(set(self.observation) | set(other.observation)):
            mine, theirs = self.observation.get(key), other.observation.get(key)
            if theirs is None:
                problems.append(f"observation {key!r} is missing")
            elif mine is None:
                problems.append(f"observation {key!r} is not in the experiment's spec")
            elif mine != theirs:
                problems.append(
                    f"observation {key!r} is {theirs.dtype}{list(theirs.shape)}, expected {mine.dtype}{list(mine.shape)}"
                )
        if self.action != other.action:
            a, b = other.action, self.action
            problems.append(
                f"action is {a.dtype}{list(a.shape)} in [{min(a.low, default=0)}, {max(a.high, default=0)}], "
                f"expected {b.dtype}{list(b.shape)} in [{min(b.low, default=0)}, {max(b.high, default=0)}]"
            )
        if not math.isclose(self.control_hz, other.control_hz, rel_tol=1e-6):
            problems.append(f"control rate {other.control_hz} Hz != {self.control_hz} Hz")
        if self.max_episode_steps != other.max_episode_steps:
            problems.append(f"episode limit {other.max_episode_steps} != {self.max_episode_steps}")
        return problems

    def check_observation(self, obs: Mapping[str, npt.NDArray[Any]], num_envs: int) -> list[str]:
        """Problems with a batch of observations (keys, dtypes, shapes)."""
        problems: list[str] = []
        for key, spec in self.observation.items():
            arr = obs.get(key)
            if arr is None:
                problems.append(f"observation {key!r} is missing")
                continue
            want = (num_envs, *spec.shape)
            if arr.dtype != spec.np_dtype or arr.shape != want:
                problems.append(
                    f"observation {key!r} is {arr.dtype}{list(arr.shape)}, expected {spec.dtype}{list(want)}"
                )
        extra = set(obs) - self.observation.keys() if len(obs) != len(self.observation) else ()
        if extra:
            problems.append(f"unexpected observation keys {sorted(extra)}")
        return problems

    def check_action(self, action: npt.NDArray[Any], num_envs: int) -> list[str]:
        """Problems with a batch of actions (dtype, shape, finite; a discrete action in
        its range). A continuous action outside its bounds is the env's to clip, as in
        Gymnasium; a discrete one out of range has no meaning and is refused here, by
        the gateway, before it reaches (and ends) an env worker."""
        spec = self.action
        want = (num_envs, *spec.shape)
        if action.dtype != spec.np_dtype or action.shape != want:
            return [f"action is {action.dtype}{list(action.shape)}, expected {spec.dtype}{list(want)}"]
        kind = action.dtype.kind
        if kind == "f" and np.count_nonzero(np.isfinite(action)) != action.size:
            return ["action contains NaN or Inf"]
        if kind in "iu" and action.size:
            low, high = spec.bounds
            outside = (action < low) | (action > high)
            if np.count_nonzero(outside):
                bad = action[outside].ravel()[:4].tolist()
                return [f"action has values outside [{low.min():g}, {high.max():g}]: {bad}"]
        return []

    def zeros(self, num_envs: int) -> Obs:
        """A batch of all-zero observations (shapes and dtypes of the spec)."""
        return {k: np.zeros((num_envs, *s.shape), dtype=s.dtype) for k, s in self.observation.items()}

    def observation_space(self) -> Any:
        """The single-env observation as a ``gymnasium.spaces.Dict``."""
        from gymnasium import spaces

        boxes: dict[str, Any] = {}
        for key, s in self.observation.items():
            dtype = np.dtype(s.dtype)
            if dtype.kind == "u" and dtype.itemsize == 1:
                boxes[key] = spaces.Box(0, 255, shape=s.shape, dtype=dtype)
            elif dtype.kind == "b":
                boxes[key] = spaces.MultiBinary(list(s.shape) or 1)
            else:
                boxes[key] = spaces.Box(-np.inf, np.inf, shape=s.shape, dtype=dtype)
        return spaces.Dict(boxes)

    def action_space(self) -> Any:
        """The single-env action as a gymnasium space (Box, or Discrete for scalar ints)."""
        from gymnasium import spaces

        a = self.action
        if a.discrete and a.shape == ():
            return spaces.Discrete(int(a.high[0] - a.low[0] + 1), start=int(a.low[0]))
        return spaces.Box(a.low_array, a.high_array, shape=a.shape, dtype=np.dtype(a.dtype))


def non_finite(obs: Obs) -> str | None:
    """Which float observations hold NaN or Inf, and in which envs ("'depth' in env(s)
    [3]"), or None."""
    bad = []
    for key, value in obs.items():
        a = np.asarray(value)
        if a.dtype.kind == "f" and a.size:
            finite = np.isfinite(a.reshape(len(a), -1)).all(axis=1)
            if not finite.all():
                bad.append(f"{key!r} in env(s) {np.flatnonzero(~finite)[:8].tolist()}")
    return "; ".join(bad) or None


class EpisodeBackend(abc.ABC):
    """A batch of environments with Gymnasium semantics (see the module docstring)."""

    spec: EnvSpec
    """What every env of this backend produces and accepts."""
    num_envs: int
    """Size of the leading env dimension of every array."""
    autoreset_mode: AutoresetMode = AutoresetMode.SAME_STEP
    """When finished envs are reset; loopgate's own backends use ``SAME_STEP``."""
    provides_final_obs: bool = True
    """Whether ``info["final_obs"]`` holds the last observation of each episode that
    ended. Simulators that reset in the same step and keep no terminal observation
    (Isaac Lab, mjlab: :mod:`sim_bridges.batched`) say False and never set it, so the
    reset observation is never stored as the old episode's terminal state; their
    episodes end without a final observation."""

    @abc.abstractmethod
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Obs, Info]:
        """Reset every env; with ``seed``, env ``i`` is seeded with ``seed + i``."""

    @abc.abstractmethod
    def step(self, action: npt.NDArray[Any]) -> StepResult:
        """Apply one action per env and advance one control period."""

    estopped: bool = False
    """Whether an emergency stop is engaged (set by :meth:`estop`)."""

    def estop(self, engaged: bool) -> None:
        """Engage or release the emergency stop for every env of this backend.

        Called from the worker the moment the gateway broadcasts an e-stop. Robot
        backends override this to command a hold at once and refuse actions until
        released; a simulator does not move between steps, and the gateway sends no
        actions while the stop is engaged, so recording the state is all it needs.
        """
        self.estopped = engaged

    keepalive: Callable[[], bool] | None = None
    """Set by the host (the env worker): call it at least every few hundred ms while a
    ``reset`` or ``step`` blocks for long (a robot moving home, waiting for an operator),
    so the host keeps answering heartbeats and handing over commands (e-stop, ``ready``)
    meanwhile. It never blocks; it returns False when the host is stopping, and the
    backend should then return as soon as it safely can."""

    def command(self, name: str, meta: Mapping[str, Any]) -> bool:
        """An operator command the gateway broadcast (e.g. ``"ready"``); False if not understood.

        Robot backends whose reset waits for a person take ``"ready"`` here; backends
        that need no operator ignore every command.
        """
        return False

    observation_device: str | None = None
    """Where a torch simulator's observation tensors live before they come to the host
    (``cpu``, ``cuda:0``); None for backends that make numpy arrays. A worker whose
    inference server shares that GPU sends them as CUDA IPC handles too (:mod:`gateway.cuda_ipc`)."""

    def device_observations(self) -> Mapping[str, Any] | None:
        """The last ``reset``'s or ``step``'s observations as tensors on ``observation_device``
        (same keys, dtypes and shapes as the numpy ones), valid until the next call of
        either; None when there are none."""
        return None

    def close(self) -> None:
        """Release simulator or robot resources; idempotent."""
        return None

    def __enter__(self) -> EpisodeBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
