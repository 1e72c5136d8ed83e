"""Isaac Lab tasks (Isaac Sim, NVIDIA GPU) as the ``isaac`` backend.

Isaac Lab runs thousands of envs of one task in one process, as torch tensors on the GPU.
This adapter only starts Isaac Sim and builds the env; everything it returns goes through
the code path it shares with mjlab (:mod:`sim_bridges.batched`: observation groups,
tensor handling, same-step autoreset without a terminal observation, ``time_outs`` as
truncations, ``extras["log"]``, checks). Isaac Sim brings its own Python, so its workers
run in that venv (:mod:`gateway.venvs`)::

    env:
      backend: isaac
      python: /opt/isaac-venv/bin/python     # Isaac Sim 6.x: Python 3.12 (5.x: 3.11)
      num_envs: 4096
      options: {task: Isaac-Reach-Franka-v0, device: "cuda:0", headless: true}

Order matters and is kept here: Isaac Lab's ``AppLauncher`` starts the simulation app
before any other Isaac module is imported (``isaaclab_tasks``, ``omni.*`` need the running
app); then ``isaaclab_tasks.utils.parse_env_cfg(task, device=, num_envs=)`` builds the
task's config and ``gym.make(task, cfg=cfg)`` the env. Isaac Sim hosts one simulation
context per process: a second backend in the same process is refused (run more workers
for more envs), and closing the backend closes the app. Nothing here imports Isaac until a
backend is built; without it, the error says what Isaac needs (:data:`REQUIREMENTS`).
"""

from __future__ import annotations

import importlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from gateway.registry import INSTALL_HINTS
from sim_bridges.batched import TorchEnvBackend, check_options

log = logging.getLogger(__name__)

REQUIREMENTS = INSTALL_HINTS["isaaclab"]
"""What Isaac Lab needs and how to install it (the text ``loopgate doctor`` and config errors show)."""

_lock = threading.Lock()
_app: Any = None
"""This process's Isaac Sim app (``AppLauncher(...).app``), once started."""
_state = "none"
"""``none`` (no app yet), ``open`` (an env lives on it) or ``closed`` (the app was closed)."""


@dataclass(frozen=True, kw_only=True)
class IsaacLabConfig:
    """Options of the ``isaac`` backend (``env.options``)."""

    task: str = "Isaac-Reach-Franka-v0"
    """A gymnasium id registered by ``isaaclab_tasks`` (``Isaac-Reach-Franka-v0``, ...)."""
    device: str = "cuda:0"
    """Simulation and tensor device (``cuda:N``; ``cpu`` runs PhysX on the CPU)."""
    headless: bool = True
    """Start Isaac Sim without a window."""
    enable_cameras: bool = False
    """Enable the off-screen render pipeline (camera sensors)."""
    groups: dict[str, str] = field(default_factory=lambda: {"policy": "policy"})
    """Observation groups to send, Isaac Lab's name -> observation key (add ``critic: critic``)."""
    max_episode_steps: int | None = None
    """Episode limit in steps (sets the task's ``episode_length_s``); None keeps the task's."""
    clip_actions: float | None = None
    """Bound actions to ``[-clip, clip]`` (Isaac Lab's action spaces are unbounded)."""

    def __post_init__(self) -> None:
        check_options(
            simulator="Isaac Lab",
            task=self.task,
            example="Isaac-Reach-Franka-v0",
            device=self.device,
            groups=self.groups,
            max_episode_steps=self.max_episode_steps,
            clip_actions=self.clip_actions,
        )


def launch_app(config: IsaacLabConfig) -> Any:
    """Start Isaac Sim through ``AppLauncher`` (once per process) and return the app."""
    global _app
    if _app is not None:
        return _app
    try:
        app_module = importlib.import_module("isaaclab.app")
    except ImportError as exc:
        # The name stays the missing module's, so the config error names Isaac's requirements.
        raise ImportError(f"Isaac Lab is not importable ({exc}): {REQUIREMENTS}", name=exc.name) from exc
    log.info(
        "starting Isaac Sim (headless=%s, device=%s, cameras=%s)",
        config.headless,
        config.device,
        config.enable_cameras,
    )
    launcher = app_module.AppLauncher(
        headless=config.headless, device=config.device, enable_cameras=config.enable_cameras
    )
    _app = launcher.app
    return _app


def make_env(config: IsaacLabConfig, num_envs: int, seed: int) -> Any:
    """The task's env on the running app: ``parse_env_cfg`` then ``gym.make(task, cfg=cfg)``."""
    gym = importlib.import_module("gymnasium")
    importlib.import_module("isaaclab_tasks")  # registers the tasks with gymnasium; needs the app
    parse_env_cfg = importlib.import_module("isaaclab_tasks.utils").parse_env_cfg
    cfg = parse_env_cfg(config.task, device=config.device, num_envs=num_envs)
    cfg.seed = seed
    if config.max_episode_steps is not None:
        step_dt = cfg.sim.dt * cfg.decimation
        # Isaac Lab times out after ceil(episode_length_s / step_dt) steps.
        cfg.episode_length_s = (config.max_episode_steps - 0.5) * step_dt
    return gym.make(config.task, cfg=cfg)


class IsaacLabBackend(TorchEnvBackend):
    """``num_envs`` envs of one Isaac Lab task in this process's one simulation context."""

    Config = IsaacLabConfig

    def __init__(self, config: IsaacLabConfig, *, num_envs: int, seed: int = 0) -> None:
        global _state
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        with _lock:
            if _state == "open":
                raise RuntimeError(
                    "Isaac Sim hosts one simulation context per process and this process has one: "
                    "run more env workers (env.workers) for more envs"
                )
            if _state == "closed":
                raise RuntimeError("this process closed its Isaac Sim app; a new one needs a new process")
            launch_app(config)
            env = make_env(config, num_envs, seed)
            _state = "open"
        self.config = config
        try:
            super().__init__(
                env,
                name=config.task,
                groups=config.groups,
                seed=seed,
                clip_actions=config.clip_actions,
                metadata={"simulator": "isaaclab", "task": config.task},
            )
        except BaseException:
            env.close()
            _close_app()
            raise

    def close(self) -> None:
        if self._closed:
            return
        try:
            super().close()  # the env first, then the app: Isaac Sim's order
        finally:
            _close_app()


def _close_app() -> None:
    """Close this process's Isaac Sim app; no app can be started in this process after it."""
    global _app, _state
    with _lock:
        if _state != "open":
            return
        _state = "closed"
        app, _app = _app, None
    if app is not None:
        app.close()
