"""mjlab tasks (Isaac Lab's manager-based env API on MuJoCo Warp) as the ``mjlab`` backend.

mjlab runs on the CPU through Warp's CPU device, so it is how the Isaac Lab code path
(:mod:`sim_bridges.batched`, shared with :mod:`sim_bridges.isaac`) is proven on machines
without a GPU. It pins ``mujoco~=3.11`` and cannot share loopgate's venv (MuJoCo 4), so its
workers run in their own venv (``make install`` makes ``.venv-mjlab``)::

    env:
      backend: mjlab
      python: .venv-mjlab/bin/python     # the interpreter of the workers
      num_envs: 64
      options: {task: Mjlab-Cartpole-Balance, device: cpu}

On the CPU set ``WARP_CACHE_PATH`` to a folder that persists: the first reset compiles
Warp's kernels (about a minute), later processes load them in under a second. mjlab
names Isaac Lab's ``policy`` group ``actor``; ``groups`` maps it to ``policy`` by default,
so a network written for Isaac Lab's keys reads mjlab's envs unchanged.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field

from sim_bridges.batched import TorchEnvBackend, check_options


@dataclass(frozen=True, kw_only=True)
class MjlabConfig:
    """Options of the ``mjlab`` backend (``env.options``)."""

    task: str = "Mjlab-Cartpole-Balance"
    """A task registered in ``mjlab.tasks`` (``mjlab.tasks.registry.list_tasks()``)."""
    device: str = "cpu"
    """Torch/Warp device of the simulation: ``cpu`` or ``cuda:N``."""
    groups: dict[str, str] = field(default_factory=lambda: {"actor": "policy", "critic": "critic"})
    """Observation groups to send, mjlab's name -> observation key."""
    max_episode_steps: int | None = None
    """Episode limit in steps (sets the task's ``episode_length_s``); None keeps the task's."""
    play: bool = False
    """Load the task's ``play`` variant (no randomisation, for evaluation)."""
    clip_actions: float | None = None
    """Bound actions to ``[-clip, clip]`` (mjlab's action spaces are unbounded; random and
    scripted policies need bounds)."""

    def __post_init__(self) -> None:
        check_options(
            simulator="mjlab",
            task=self.task,
            example="Mjlab-Cartpole-Balance",
            device=self.device,
            groups=self.groups,
            max_episode_steps=self.max_episode_steps,
            clip_actions=self.clip_actions,
        )


class MjlabBackend(TorchEnvBackend):
    """``num_envs`` envs of one mjlab task in one ``ManagerBasedRlEnv``."""

    Config = MjlabConfig

    def __init__(self, config: MjlabConfig, *, num_envs: int, seed: int = 0) -> None:
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        if config.device == "cpu":
            # Warp otherwise probes for a CUDA driver; it must be set before Warp loads.
            os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
        registry = importlib.import_module("mjlab.tasks.registry")
        importlib.import_module("mjlab.tasks")  # registers the bundled tasks
        env_module = importlib.import_module("mjlab.envs")
        known = registry.list_tasks()
        if config.task not in known:
            raise ValueError(
                f"env.options.task: unknown mjlab task {config.task!r}; known: {', '.join(known)}"
            )
        cfg = registry.load_env_cfg(config.task, play=config.play)
        cfg.scene.num_envs = num_envs
        cfg.seed = seed
        if config.max_episode_steps is not None:
            step_dt = cfg.sim.mujoco.timestep * cfg.decimation
            # The env times out after ceil(episode_length_s / step_dt) steps.
            cfg.episode_length_s = (config.max_episode_steps - 0.5) * step_dt
        env = env_module.ManagerBasedRlEnv(cfg, device=config.device)
        self.config = config
        super().__init__(
            env,
            name=config.task,
            groups=config.groups,
            seed=seed,
            clip_actions=config.clip_actions,
            metadata={"simulator": "mjlab", "task": config.task},
        )
