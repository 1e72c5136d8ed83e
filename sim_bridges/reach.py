"""The reach task in plain numpy: kinematics, sampling, reward, success, observations.

A three-joint planar arm (all joints turn about z) moves its fingertip onto a target on
the table. Nothing here simulates anything: the MuJoCo backend
(:mod:`sim_bridges.mujoco`) and a real robot's backend both hand joint states to a
:class:`ReachTask` and get the same observations, rewards and success flags back::

    task = ReachTask()
    joint_pos, target = task.sample_initial(rng)         # f64[3], f64[2]
    ctrl = task.apply_action(ctrl, action)               # new joint position targets
    obs = task.observe(joint_pos, joint_vel, target)     # {"joint_pos": f32[..., 3], ...}
    reward = task.reward(obs["ee_pos"], target)          # -distance, f32
    spec = task.spec(max_episode_steps=50)               # the EnvSpec both backends report

Observation (all float32, per env): ``joint_pos`` [3] (rad), ``joint_vel`` [3] (rad/s),
``ee_pos`` [2] (fingertip x, y in m, base at the origin), ``target_pos`` [2] and
``target_rel`` [2] = target - fingertip. ``target_rel`` is redundant but saves a learner
from having to discover a subtraction; it is the one input a reaching policy needs most.
A camera adds ``image`` (uint8 [H, W, 3]).

Action: float32 [3] in [-1, 1], joint position deltas in units of ``max_delta`` rad,
added to the arm's current position targets (not its measured position) and clipped to
the joint limits; values outside [-1, 1] are clipped.

Reward is ``-distance`` (m) between fingertip and target, with no shaping: it is dense,
already well scaled, and learners reach 80 % success with it (see ENVIRONMENT.md).
Success is ``distance < success_radius``. Episodes end by truncation at the step limit
unless ``terminate_on_success`` is set: with a distance reward, ending an episode on
arrival would stop the learner from practising holding the target.

:class:`ReachTaskOptions` holds the task's ``env.options`` (episode limit, success radius,
targets, camera) that every reach backend extends, and :class:`ReachPDPolicy` is the
scripted controller registered as ``reach_pd``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from gateway.episode import ActionSpec, ArraySpec, EnvSpec, Obs
from gateway.policies import Policy

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.floating[Any]]

TASK_NAME = "reach"
OBS_KEYS = ("joint_pos", "joint_vel", "ee_pos", "target_pos", "target_rel")
"""Observation keys every reach backend produces (a camera adds ``image``)."""
IMAGE_KEY = "image"


@dataclass(frozen=True, kw_only=True)
class ReachTask:
    """Geometry and rules of the reach task; every method works on a batch (leading dims)."""

    link_lengths: tuple[float, float, float] = (0.12, 0.10, 0.08)
    """Length of each link (m), base to fingertip; must match the robot or MJCF."""
    joint_low: tuple[float, float, float] = (-3.0, -2.5, -2.5)
    """Lower joint position limits (rad)."""
    joint_high: tuple[float, float, float] = (3.0, 2.5, 2.5)
    """Upper joint position limits (rad)."""
    home_joint_pos: tuple[float, float, float] = (0.0, 0.6, 0.6)
    """Posture episodes start around (rad); bent, so the arm starts away from the straight-arm singularity."""
    init_noise: float = 0.3
    """Half-width (rad) of the uniform noise added to ``home_joint_pos`` at reset."""
    target_min_radius: float = 0.10
    """Nearest target distance from the base (m)."""
    target_max_radius: float = 0.26
    """Farthest target distance from the base (m); below the 0.30 m full reach."""
    target_max_angle: float = 1.5
    """Targets lie within +-this angle (rad) of the x axis."""
    success_radius: float = 0.05
    """Fingertip-target distance (m) below which a step counts as a success."""
    max_delta: float = 0.15
    """Joint position target change (rad) of a full-scale action in one control step."""
    terminate_on_success: bool = False
    """End the episode (terminated) on the first successful step instead of at the step limit."""

    def __post_init__(self) -> None:
        # Every message starts with the field's name, so a config wrapping this task can
        # prefix its own path (``env.options.``) and name the field for the user.
        for name in ("link_lengths", "joint_low", "joint_high", "home_joint_pos"):
            value = tuple(float(v) for v in getattr(self, name))
            if len(value) != 3:
                raise ValueError(f"{name} must have 3 elements, got {value!r}")
            object.__setattr__(self, name, value)
        reach = sum(self.link_lengths)
        checks: list[tuple[str, bool, str]] = [
            ("link_lengths", all(length > 0 for length in self.link_lengths), "> 0"),
            ("joint_high", all(lo < hi for lo, hi in zip(self.joint_low, self.joint_high)), "> joint_low"),
            ("init_noise", self.init_noise >= 0, ">= 0"),
            ("target_min_radius", self.target_min_radius >= 0, ">= 0"),
            (
                "target_max_radius",
                self.target_min_radius <= self.target_max_radius < reach,
                f">= target_min_radius ({self.target_min_radius}) and below the arm's reach ({reach:.2f} m)",
            ),
            ("target_max_angle", 0 <= self.target_max_angle <= np.pi, "in [0, pi]"),
            ("success_radius", self.success_radius > 0, "> 0"),
            ("max_delta", 0 < self.max_delta <= 1.0, "in (0, 1] rad"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> ReachTask:
        """The task described by an :class:`EnvSpec`'s metadata (see :meth:`spec`)."""
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {
            k: (tuple(v) if isinstance(v, list) else v) for k, v in metadata.items() if k in names
        }
        return cls(**kwargs)

    # ------------------------------------------------------------------ kinematics

    # Arrays of the tuples above, built once: converting a tuple costs as much as the
    # arithmetic at a control step. (cached_property writes the instance __dict__
    # directly, which a frozen dataclass allows.)
    @functools.cached_property
    def _low(self) -> FloatArray:
        return np.asarray(self.joint_low)

    @functools.cached_property
    def _high(self) -> FloatArray:
        return np.asarray(self.joint_high)

    @functools.cached_property
    def _lengths(self) -> FloatArray:
        return np.asarray(self.link_lengths)

    @functools.cached_property
    def home(self) -> FloatArray:
        """:attr:`home_joint_pos` as a float64 array (built once)."""
        return np.asarray(self.home_joint_pos, dtype=np.float64)

    @functools.cached_property
    def _outward(self) -> FloatArray:
        """``v @ _outward``: for each joint, the sum of ``v`` over its link and those beyond."""
        return np.tril(np.ones((len(self.link_lengths),) * 2))

    def ee_pos(self, joint_pos: npt.ArrayLike) -> FloatArray:
        """Fingertip (x, y) for joint positions ``[..., 3]`` -> ``[..., 2]`` (float64)."""
        # Written for a small batch at every control step: ufuncs and matmul into a
        # preallocated result cost a third of np.cumsum/np.stack here.
        angles = np.add.accumulate(np.asarray(joint_pos, dtype=np.float64), axis=-1)
        ee = np.empty((*angles.shape[:-1], 2))
        ee[..., 0] = np.cos(angles) @ self._lengths
        ee[..., 1] = np.sin(angles) @ self._lengths
        return ee

    def link_vectors(self, joint_pos: npt.ArrayLike) -> tuple[FloatArray, FloatArray]:
        """Each link's x and y extent for joint positions ``[..., 3]``: two ``[..., 3]``
        (their sums are the fingertip)."""
        angles = np.add.accumulate(np.asarray(joint_pos, dtype=np.float64), axis=-1)
        return np.cos(angles) * self._lengths, np.sin(angles) * self._lengths

    def jacobian_rows(self, lx: FloatArray, ly: FloatArray) -> tuple[FloatArray, FloatArray]:
        """d(x)/d(joint_pos) and d(y)/d(joint_pos) from :meth:`link_vectors`: two ``[..., 3]``.
        Joint j moves every link from j outwards (one matmul each, for a small batch at
        every control step)."""
        return -(ly @ self._outward), lx @ self._outward

    def jacobian(self, joint_pos: npt.ArrayLike) -> FloatArray:
        """d(fingertip)/d(joint_pos): ``[..., 3]`` -> ``[..., 2, 3]``."""
        return np.stack(self.jacobian_rows(*self.link_vectors(joint_pos)), axis=-2)

    # ----------------------------------------------------------------- the rules

    def sample_initial(self, rng: np.random.Generator) -> tuple[FloatArray, FloatArray]:
        """Start posture (rad, [3]) and target (m, [2]) of one episode."""
        noise = rng.uniform(-self.init_noise, self.init_noise, size=3)
        joint_pos = np.clip(self.home + noise, self._low, self._high)
        # sqrt of a uniform squared radius: uniform over the annulus's area, not its radius.
        radius = np.sqrt(rng.uniform(self.target_min_radius**2, self.target_max_radius**2))
        angle = rng.uniform(-self.target_max_angle, self.target_max_angle)
        return joint_pos, np.array([radius * np.cos(angle), radius * np.sin(angle)])

    def apply_action(self, ctrl: FloatArray, action: npt.ArrayLike) -> FloatArray:
        """New joint position targets: ``ctrl + max_delta * clip(action, -1, 1)`` within the limits."""
        delta = np.minimum(np.maximum(action, -1.0), 1.0) * self.max_delta
        out: FloatArray = np.minimum(np.maximum(ctrl + delta, self._low), self._high)
        return out

    def distance(self, ee: npt.ArrayLike, target: npt.ArrayLike) -> npt.NDArray[np.float32]:
        """Fingertip-target distance (m), float32 ``[...]``."""
        diff = np.asarray(target, dtype=np.float64) - np.asarray(ee, dtype=np.float64)
        return np.hypot(diff[..., 0], diff[..., 1]).astype(np.float32)

    def reward(self, ee: npt.ArrayLike, target: npt.ArrayLike) -> npt.NDArray[np.float32]:
        """Dense reward: ``-distance`` (float32)."""
        return -self.distance(ee, target)

    def success(self, ee: npt.ArrayLike, target: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """Whether the fingertip is within ``success_radius`` of the target."""
        return self.distance(ee, target) < self.success_radius

    def terminated(self, success: npt.NDArray[np.bool_]) -> npt.NDArray[np.bool_]:
        """Which envs end their episode on this step's ``success``."""
        out: npt.NDArray[np.bool_] = success.copy() if self.terminate_on_success else np.zeros_like(success)
        return out

    def outcome(
        self, obs: Obs
    ) -> tuple[
        npt.NDArray[np.float32], npt.NDArray[np.bool_], npt.NDArray[np.bool_], npt.NDArray[np.float32]
    ]:
        """Reward, success, terminated and distance (m) of observations made by :meth:`observe`."""
        rel = obs["target_rel"]
        distance = np.hypot(rel[..., 0], rel[..., 1])
        success = distance < self.success_radius
        return -distance, success, self.terminated(success), distance

    def observe(self, joint_pos: npt.ArrayLike, joint_vel: npt.ArrayLike, target: npt.ArrayLike) -> Obs:
        """The observation dict (float32, fresh arrays) for joint states and targets ``[..., n]``."""
        joint_pos = np.asarray(joint_pos, dtype=np.float64)
        target = np.asarray(target, dtype=np.float64)
        ee = self.ee_pos(joint_pos)
        return {
            "joint_pos": joint_pos.astype(np.float32),
            "joint_vel": np.asarray(joint_vel, dtype=np.float32).copy(),
            "ee_pos": ee.astype(np.float32),
            "target_pos": target.astype(np.float32),
            "target_rel": (target - ee).astype(np.float32),
        }

    def spec(
        self,
        *,
        max_episode_steps: int = 50,
        control_hz: float = 20.0,
        image_shape: tuple[int, int] | None = None,
    ) -> EnvSpec:
        """The :class:`EnvSpec` of this task; ``image_shape`` = (height, width) adds ``image``."""
        observation = {
            "joint_pos": ArraySpec(dtype="float32", shape=(3,)),
            "joint_vel": ArraySpec(dtype="float32", shape=(3,)),
            "ee_pos": ArraySpec(dtype="float32", shape=(2,)),
            "target_pos": ArraySpec(dtype="float32", shape=(2,)),
            "target_rel": ArraySpec(dtype="float32", shape=(2,)),
        }
        if image_shape is not None:
            observation[IMAGE_KEY] = ArraySpec(dtype="uint8", shape=(*image_shape, 3))
        metadata: dict[str, Any] = {
            f.name: (list(v) if isinstance(v, tuple) else v)
            for f in dataclasses.fields(self)
            for v in [getattr(self, f.name)]
        }
        metadata["reward"] = "-distance"
        metadata["action"] = "joint position target deltas, scaled by max_delta (rad)"
        return EnvSpec(
            name=TASK_NAME,
            observation=observation,
            action=ActionSpec(dtype="float32", shape=(3,), low=(-1.0,) * 3, high=(1.0,) * 3),
            control_hz=control_hz,
            max_episode_steps=max_episode_steps,
            metadata=metadata,
        )


_TASK = ReachTask()
_MAX_IMAGE_SIDE = 1024


@dataclass(frozen=True, kw_only=True)
class ReachTaskOptions:
    """The reach task's options as every reach backend takes them (``env.options``).

    Backends extend this with their own fields (physics for MuJoCo, topics for a real
    arm), so a sim config and its real twin name the task's options alike and report
    the same spec.
    """

    max_episode_steps: int = 50
    """Steps after which an episode is truncated (2.5 s at 20 Hz)."""
    success_radius: float = _TASK.success_radius
    """Fingertip-target distance (m) below which a step counts as a success."""
    max_delta: float = _TASK.max_delta
    """Joint position target change (rad) of a full-scale action in one control step."""
    terminate_on_success: bool = _TASK.terminate_on_success
    """End an episode on its first successful step (terminated) instead of only at the step limit."""
    target_min_radius: float = _TASK.target_min_radius
    """Nearest target distance from the arm's base (m)."""
    target_max_radius: float = _TASK.target_max_radius
    """Farthest target distance from the arm's base (m); the arm reaches 0.30."""
    target_max_angle: float = _TASK.target_max_angle
    """Targets lie within +-this angle (rad) of the arm's x axis."""
    init_noise: float = _TASK.init_noise
    """Half-width (rad) of the uniform noise on the start posture."""
    camera: bool = False
    """Add an ``image`` observation (uint8 [image_height, image_width, 3])."""
    image_width: int = 84
    """Camera image width (pixels)."""
    image_height: int = 84
    """Camera image height (pixels)."""

    def __post_init__(self) -> None:
        checks: list[tuple[str, bool, str]] = [
            ("max_episode_steps", self.max_episode_steps >= 1, ">= 1"),
            ("image_width", 1 <= self.image_width <= _MAX_IMAGE_SIDE, f"in 1..{_MAX_IMAGE_SIDE}"),
            ("image_height", 1 <= self.image_height <= _MAX_IMAGE_SIDE, f"in 1..{_MAX_IMAGE_SIDE}"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"env.options.{name} must be {rule}, got {getattr(self, name)!r}")
        try:
            self.task()
        except ValueError as exc:
            # ReachTask's messages start with the field name, which is also ours.
            raise ValueError(f"env.options.{exc}") from exc

    def task(self) -> ReachTask:
        """The task these options describe (the arm's geometry keeps its defaults)."""
        return ReachTask(
            success_radius=self.success_radius,
            max_delta=self.max_delta,
            terminate_on_success=self.terminate_on_success,
            target_min_radius=self.target_min_radius,
            target_max_radius=self.target_max_radius,
            target_max_angle=self.target_max_angle,
            init_noise=self.init_noise,
        )

    def task_spec(self, *, control_hz: float) -> EnvSpec:
        """The :class:`EnvSpec` a backend with these options reports."""
        image = (self.image_height, self.image_width) if self.camera else None
        return self.task().spec(
            max_episode_steps=self.max_episode_steps, control_hz=control_hz, image_shape=image
        )


# ------------------------------------------------------------------- scripted policy


@dataclass(frozen=True, kw_only=True)
class ReachPDConfig:
    """Options of the ``reach_pd`` scripted policy (``policy.options``)."""

    gain: float = 0.5
    """Fraction of the fingertip error the policy asks to close in one control step."""
    lookahead_s: float = 0.05
    """Seconds of current joint velocity added to the fingertip before taking the error (the D term)."""
    damping: float = 0.03
    """Damped-least-squares damping (m): trades accuracy for calm motion near singular postures."""
    null_gain: float = 0.05
    """Pull toward the task's home posture in the Jacobian's null space (per step, 0 disables)."""

    def __post_init__(self) -> None:
        if not 0 < self.gain <= 2:
            raise ValueError(f"policy.options.gain must be in (0, 2], got {self.gain}")
        if not 0 <= self.lookahead_s <= 1:
            raise ValueError(f"policy.options.lookahead_s must be in [0, 1], got {self.lookahead_s}")
        if not self.damping > 0:
            raise ValueError(f"policy.options.damping must be > 0, got {self.damping}")
        if not 0 <= self.null_gain <= 1:
            raise ValueError(f"policy.options.null_gain must be in [0, 1], got {self.null_gain}")


class ReachPDPolicy(Policy):
    """Damped-least-squares IK with a P(D) law on the fingertip error, from the observation alone.

    The arm's geometry comes from the spec's metadata, so the policy drives any backend
    that reports the reach task (MuJoCo or a real arm).
    """

    Config = ReachPDConfig

    def __init__(self, spec: EnvSpec, config: ReachPDConfig | None = None, *, seed: int = 0) -> None:
        super().__init__(spec, config or ReachPDConfig(), seed=seed)
        missing = sorted({"joint_pos", "joint_vel", "target_pos"} - set(spec.observation))
        if spec.name != TASK_NAME or missing:
            raise ValueError(
                f"policy reach_pd drives the {TASK_NAME!r} task; got task {spec.name!r}"
                + (f" without observation(s) {missing}" if missing else "")
            )
        if spec.action.shape != (3,):
            raise ValueError(f"policy reach_pd needs a [3] action, got {list(spec.action.shape)}")
        self.task = ReachTask.from_metadata(spec.metadata)
        self._ones = np.ones(3)

    def act(self, obs: Obs) -> np.ndarray:
        # Written out for a planar arm's two task rows: the 2x2 damped inverse in closed
        # form and each row product as one matmul, where einsum, np.linalg.inv, np.stack
        # and np.eye cost most of a small batch: 79 -> 39 us a call at one env, 62 -> 41
        # at eight, 230 -> 90 at 256 (the gateway runs it once a worker's message).
        cfg: ReachPDConfig = self.config
        task, ones = self.task, self._ones
        q = np.asarray(obs["joint_pos"], dtype=np.float64)
        qd = np.asarray(obs["joint_vel"], dtype=np.float64)
        lx, ly = task.link_vectors(q)
        jx, jy = task.jacobian_rows(lx, ly)  # d(x)/dq, d(y)/dq: [n, 3]
        # Where the fingertip is heading: the servos lag their targets, so act on a
        # prediction a little ahead instead of the measured position (the D term).
        ex = lx @ ones + cfg.lookahead_s * ((jx * qd) @ ones)
        ey = ly @ ones + cfg.lookahead_s * ((jy * qd) @ ones)
        target = np.asarray(obs["target_pos"], dtype=np.float64)
        dx, dy = cfg.gain * (target[:, 0] - ex), cfg.gain * (target[:, 1] - ey)
        # Damped least squares: pinv = J^T (J J^T + damping^2 I)^-1, the 2x2 inverse by hand.
        d2 = cfg.damping**2
        a, b, d = (jx * jx) @ ones + d2, (jx * jy) @ ones, (jy * jy) @ ones + d2
        det = a * d - b * b
        i00, i01, i11 = d / det, -b / det, a / det
        px = jx * i00[:, None] + jy * i01[:, None]  # pinv's columns: [n, 3] each
        py = jx * i01[:, None] + jy * i11[:, None]
        dq = px * dx[:, None] + py * dy[:, None]
        # The spare degree of freedom drifts toward the home posture, away from the
        # joint limits and the straight-arm singularity, without moving the fingertip:
        # (I - pinv J) h = h - pinv (J h).
        h = task.home - q
        dq += cfg.null_gain * (h - px * ((jx * h) @ ones)[:, None] - py * ((jy * h) @ ones)[:, None])
        action = dq / task.max_delta
        # Scale the whole vector down rather than clip each joint: keeps the direction.
        scale = np.maximum(1.0, np.abs(action).max(axis=-1, keepdims=True))
        out: np.ndarray = (action / scale).astype(self.spec.action.dtype)
        return out
