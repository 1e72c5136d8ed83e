"""The reach task simulated in MuJoCo: a batched episode backend and a Gymnasium env.

:class:`MujocoReachBackend` is the ``mujoco_reach`` backend: one ``MjModel`` of
``assets/reach_arm.xml`` and one ``MjData`` per env, stepped in a loop, with the task's
rules from :class:`sim_bridges.reach.ReachTask`::

    backend = make_backend("mujoco_reach", num_envs=8, seed=0, options={"camera": True})
    obs, info = backend.reset(seed=0)     # joint_pos f32[8, 3], ..., image u8[8, 84, 84, 3]
    obs, reward, terminated, truncated, info = backend.step(action)   # action f32[8, 3]

Finished envs reset in the same step (``AutoresetMode.SAME_STEP``): ``obs`` then holds
their next episode's first observation and ``info["final_obs"]`` (present on steps where
any env finished) the observation that ended the step for every env, which for envs that
did not finish is their ``obs``. ``info["success"]`` (bool) and ``info["distance"]``
(float32, m) describe the step just taken. Returned arrays are fresh on every call; the
caller may keep or send them without copying.

:class:`ReachEnv` is the same task as one plain ``gymnasium.Env``, registered as
``loopgate/Reach-v0`` (truncation comes from gymnasium's ``TimeLimit``), for use under
gymnasium's own vector envs, e.g. as the baseline in benchmarks. Both build on
:class:`ReachSim`, so the physics and the task are the same code.

Cameras render offscreen without a display or GPU; see :mod:`sim_bridges.rendering`
for how the OpenGL platform is chosen.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from types import ModuleType
from typing import TYPE_CHECKING, Any

import gymnasium
import numpy as np
import numpy.typing as npt

from gateway.episode import AutoresetMode, EnvSpec, EpisodeBackend, Info, Obs, StepResult
from sim_bridges.reach import IMAGE_KEY, ReachTask, ReachTaskOptions
from sim_bridges.rendering import BatchCamera, import_mujoco

if TYPE_CHECKING:
    import mujoco

logger = logging.getLogger(__name__)

GYMNASIUM_ID = "loopgate/Reach-v0"
CAMERA_NAME = "top"
FINGERTIP_SITE = "fingertip"


@dataclass(frozen=True, kw_only=True)
class MujocoReachConfig(ReachTaskOptions):
    """Options of the ``mujoco_reach`` backend (``env.options``) and of ``ReachEnv``.

    The task's options (episode limit, success radius, targets, camera) are
    :class:`ReachTaskOptions`', shared with the real arm's backend so that a sim config
    and its real twin spell them alike; the arm's geometry is the shipped model's.
    """

    timestep: float = 0.01
    """Physics timestep (s); the servos stay stable and accurate up to 0.025."""
    substeps: int = 5
    """Physics steps per control step; the control rate is 1 / (timestep * substeps)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.timestep <= 0.025:
            raise ValueError(f"env.options.timestep must be in (0, 0.025] s, got {self.timestep!r}")
        if self.substeps < 1:
            raise ValueError(f"env.options.substeps must be >= 1, got {self.substeps!r}")

    @property
    def control_hz(self) -> float:
        return 1.0 / (self.timestep * self.substeps)

    def spec(self) -> EnvSpec:
        return self.task_spec(control_hz=self.control_hz)


def load_model(mj: ModuleType, task: ReachTask, timestep: float) -> mujoco.MjModel:
    """The shipped arm model, checked against the task's kinematics and joint limits."""
    xml = resources.files("sim_bridges").joinpath("assets/reach_arm.xml").read_text()
    model = mj.MjModel.from_xml_string(xml)
    model.opt.timestep = timestep
    limits = np.asarray([task.joint_low, task.joint_high]).T
    if not np.allclose(model.jnt_range, limits):
        raise ValueError(
            f"reach_arm.xml joint ranges {model.jnt_range.tolist()} != task limits {limits.tolist()}"
        )
    # A wrong link length in the MJCF would silently make rewards disagree with the
    # picture; compare the fingertip site with the task's kinematics once at load.
    data = mj.MjData(model)
    site = model.site(FINGERTIP_SITE).id
    for q in np.random.default_rng(0).uniform(limits[:, 0], limits[:, 1], size=(4, 3)):
        data.qpos[:] = q
        mj.mj_kinematics(model, data)
        if not np.allclose(data.site_xpos[site, :2], task.ee_pos(q), atol=1e-6):
            raise ValueError("reach_arm.xml link lengths disagree with ReachTask.link_lengths")
    return model


class ReachSim:
    """``num_envs`` reach arms in one MuJoCo model: physics, resets and observations.

    No episode bookkeeping beyond a step counter; :class:`MujocoReachBackend` and
    :class:`ReachEnv` decide what ends an episode.
    """

    def __init__(self, config: MujocoReachConfig, *, num_envs: int, seed: int, render: bool = False) -> None:
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        self.config = config
        self.num_envs = num_envs
        self.task = config.task()
        self._mj = import_mujoco(rendering=render or config.camera)
        self.model = load_model(self._mj, self.task, config.timestep)
        self.datas = [self._mj.MjData(self.model) for _ in range(num_envs)]
        self.ctrl: npt.NDArray[np.floating[Any]] = np.zeros((num_envs, 3))
        """Joint position targets the servos track (rad); actions move these."""
        self.joint_pos = np.zeros((num_envs, 3))
        self.joint_vel = np.zeros((num_envs, 3))
        self.target = np.zeros((num_envs, 2))
        self.steps = np.zeros(num_envs, dtype=np.int64)
        """Control steps since each env's last reset."""
        self.rngs = [np.random.default_rng(seed + i) for i in range(num_envs)]
        self.camera: BatchCamera | None = None
        if render or config.camera:
            self.camera = BatchCamera(
                self._mj, self.model, camera=CAMERA_NAME, height=config.image_height, width=config.image_width
            )

    def seed(self, seed: int) -> None:
        self.rngs = [np.random.default_rng(seed + i) for i in range(self.num_envs)]

    def reset(self, envs: Sequence[int] | npt.NDArray[np.integer[Any]]) -> None:
        """Start a new episode in each of ``envs`` from its own random generator."""
        mj, model = self._mj, self.model
        for i in envs:
            joint_pos, target = self.task.sample_initial(self.rngs[i])
            data = self.datas[i]
            mj.mj_resetData(model, data)
            data.qpos[:] = joint_pos
            data.ctrl[:] = joint_pos
            data.mocap_pos[0, :2] = target
            # Poses for the camera before the first step: bodies, then the camera itself.
            mj.mj_kinematics(model, data)
            mj.mj_camlight(model, data)
            self.ctrl[i] = joint_pos
            self.joint_pos[i] = joint_pos
            self.joint_vel[i] = 0.0
            self.target[i] = target
            self.steps[i] = 0

    def advance(self, action: npt.NDArray[Any]) -> None:
        """Move every env's position targets by ``action`` and simulate one control period."""
        mj, model, nstep = self._mj, self.model, self.config.substeps
        self.ctrl = self.task.apply_action(self.ctrl, action)
        for i, data in enumerate(self.datas):
            data.ctrl[:] = self.ctrl[i]
            mj.mj_step(model, data, nstep=nstep)
            self.joint_pos[i] = data.qpos
            self.joint_vel[i] = data.qvel
            if self.camera is not None:
                # mj_step leaves body poses from before its last integration; the
                # picture must match joint_pos.
                mj.mj_kinematics(model, data)
        self.steps += 1

    def observe(self, envs: npt.NDArray[np.integer[Any]] | None = None) -> Obs:
        """Observations of ``envs`` (default all), fresh arrays with a leading env dim."""
        select: Any = slice(None) if envs is None else envs
        obs = self.task.observe(self.joint_pos[select], self.joint_vel[select], self.target[select])
        if self.config.camera and self.camera is not None:
            datas = self.datas if envs is None else [self.datas[i] for i in envs]
            obs[IMAGE_KEY] = self.camera.render(datas)
        return obs

    def evaluate(
        self, obs: Obs
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.bool_], npt.NDArray[np.bool_], Info]:
        """Reward, success, terminated and the step's info for observations ``obs``."""
        reward, success, terminated, distance = self.task.outcome(obs)
        return reward, success, terminated, {"success": success, "distance": distance}

    def render(self, env: int = 0) -> npt.NDArray[np.uint8]:
        if self.camera is None:
            raise RuntimeError("this simulation was built without a renderer")
        image: npt.NDArray[np.uint8] = self.camera.render([self.datas[env]])[0]
        return image

    def close(self) -> None:
        if self.camera is not None:
            self.camera.close()
            self.camera = None


class MujocoReachBackend(EpisodeBackend):
    """The reach task in MuJoCo, ``num_envs`` arms stepped in one process (see the module docstring)."""

    Config = MujocoReachConfig
    autoreset_mode = AutoresetMode.SAME_STEP

    def __init__(self, config: MujocoReachConfig | None = None, *, num_envs: int, seed: int = 0) -> None:
        self.config = config or MujocoReachConfig()
        self.num_envs = num_envs
        self.spec = self.config.spec()
        self._sim: ReachSim | None = ReachSim(self.config, num_envs=num_envs, seed=seed)
        if self._sim.camera is not None:
            # A worker should learn at start-up, not at its first reset, that it cannot render.
            self._sim.camera.open()
        self._sim.reset(range(num_envs))
        self._all = np.arange(num_envs)

    def _live(self) -> ReachSim:
        if self._sim is None:
            raise RuntimeError("mujoco_reach backend is closed")
        return self._sim

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Obs, Info]:
        if options:
            raise ValueError(f"mujoco_reach takes no reset options, got {sorted(options)}")
        sim = self._live()
        if seed is not None:
            sim.seed(seed)
        sim.reset(self._all)
        obs = sim.observe()
        _, _, _, info = sim.evaluate(obs)
        return obs, info

    def step(self, action: npt.NDArray[Any]) -> StepResult:
        sim = self._live()
        action = np.asarray(action)
        problems = self.spec.check_action(action, self.num_envs)
        if problems:
            raise ValueError(f"mujoco_reach: {'; '.join(problems)}")
        sim.advance(action)
        obs = sim.observe()
        reward, _, terminated, info = sim.evaluate(obs)
        truncated = sim.steps >= self.config.max_episode_steps
        done = terminated | truncated
        if np.count_nonzero(done):
            finished = np.flatnonzero(done)
            info["final_obs"] = obs
            sim.reset(finished)
            fresh = sim.observe(finished)
            obs = {key: value.copy() for key, value in obs.items()}
            for key, value in fresh.items():
                obs[key][finished] = value
        return obs, reward, terminated, truncated, info

    def close(self) -> None:
        if self._sim is not None:
            self._sim.close()
            self._sim = None


def _single_info(info: Info) -> dict[str, Any]:
    return {"success": bool(info["success"][0]), "distance": float(info["distance"][0])}


class ReachEnv(gymnasium.Env[dict[str, np.ndarray], np.ndarray]):
    """The reach task as one ``gymnasium.Env`` (``loopgate/Reach-v0``).

    Keyword arguments are :class:`MujocoReachConfig` fields. The env never truncates by
    itself: ``gymnasium.make`` wraps it in ``TimeLimit`` with ``max_episode_steps``. Its
    OpenGL context is created at the first image, so ``AsyncVectorEnv`` may fork after
    building one (as it does); a process that has rendered should not fork renderers.
    """

    metadata: dict[str, Any] = {"render_modes": ["rgb_array"], "render_fps": 20, "success_key": "success"}  # noqa: RUF012

    def __init__(self, render_mode: str | None = None, **options: Any) -> None:
        from gateway.config import build

        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"render_mode must be None or 'rgb_array', got {render_mode!r}")
        self.config: MujocoReachConfig = build(MujocoReachConfig, options, "env.options")
        self.render_mode = render_mode
        self.env_spec = self.config.spec()
        self.metadata = {**self.metadata, "render_fps": self.config.control_hz}
        self.observation_space = self.env_spec.observation_space()
        self.action_space = self.env_spec.action_space()
        self._sim = ReachSim(self.config, num_envs=1, seed=0, render=render_mode == "rgb_array")

    def _single(self, obs: Obs) -> dict[str, np.ndarray]:
        return {key: value[0] for key, value in obs.items()}

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        super().reset(seed=seed, options=options)
        # The episode draws from gymnasium's np_random so that seeding follows gymnasium's rules.
        self._sim.rngs[0] = self.np_random
        self._sim.reset([0])
        obs = self._sim.observe()
        _, _, _, info = self._sim.evaluate(obs)
        return self._single(obs), _single_info(info)

    def step(self, action: Any) -> tuple[dict[str, np.ndarray], float, bool, bool, dict[str, Any]]:
        batch = np.asarray(action, dtype=np.float32).reshape(1, -1)
        problems = self.env_spec.check_action(batch, 1)
        if problems:
            raise ValueError(f"{GYMNASIUM_ID}: {'; '.join(problems)}")
        self._sim.advance(batch)
        obs = self._sim.observe()
        reward, _, terminated, info = self._sim.evaluate(obs)
        return self._single(obs), float(reward[0]), bool(terminated[0]), False, _single_info(info)

    def render(self) -> npt.NDArray[np.uint8] | None:
        if self.render_mode is None:
            return None
        return self._sim.render(0)

    def close(self) -> None:
        self._sim.close()
        super().close()


if GYMNASIUM_ID not in gymnasium.registry:
    gymnasium.register(
        id=GYMNASIUM_ID,
        entry_point="sim_bridges.mujoco:ReachEnv",
        max_episode_steps=MujocoReachConfig().max_episode_steps,
    )
