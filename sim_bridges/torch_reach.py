"""A batched reach simulator in torch: thousands of envs in one tensor, Isaac Lab's API.

A planar three-joint arm per env moves its fingertip onto a target; every env's state is
a row of the same tensors, on CPU or CUDA, so one ``step`` advances all of them with a
few tensor operations. It has the shape of an Isaac Lab manager-based RL env (what the
Isaac Lab adapter wraps), which makes it the fast stand-in for experiments and for
``loopgate bench`` where Isaac Sim cannot run::

    env = TorchReachEnv(TorchReachConfig(device="cpu"), num_envs=4096, seed=0)
    obs, extras = env.reset()                   # obs: {"policy": f32[4096, 15]} on env.device
    while training:
        obs, reward, terminated, time_outs, extras = env.step(actions)   # actions: [4096, 3]
        # finished envs were reset in this same step: obs["policy"] of a done env is the
        # first observation of its next episode; the terminal one is returned nowhere.
        # extras["log"] exists only on steps where some env was reset.

Isaac Lab semantics kept on purpose, because the adapter has to get them right:

- ``terminated`` and ``time_outs`` are the env's own buffers, overwritten in place by
  the next ``step``: clone them before handing them to another thread or process;
- ``time_outs`` are truncations at ``episode_length`` (a learner bootstraps there),
  ``terminated`` are true ends (the fingertip held inside ``success_radius``, when
  ``terminate_on_success``);
- ``reward`` is ``-distance`` (m), float32 [num_envs], on ``env.device``.

Observation ``"policy"`` (float32, per env, in this order): joint positions [3] (rad),
joint velocities [3] (rad/s), fingertip [2] (m), target [2] (m), target - fingertip [2]
and the previous action [3] (:data:`OBS_LAYOUT` gives the slices). Action: float32 [3] in [-1, 1], joint velocity commands in units of
``max_joint_vel`` rad/s, integrated over ``dt``; joint positions are clipped to their
limits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from sim_bridges.batched import TorchEnvBackend

LINKS = (0.35, 0.3, 0.25)
"""Link lengths (m): the arm reaches 0.9 m from its base."""
JOINT_LIMIT = math.pi * 0.9
"""Each joint turns within [-JOINT_LIMIT, JOINT_LIMIT] rad."""
OBS_LAYOUT: dict[str, slice] = {
    "joint_pos": slice(0, 3),
    "joint_vel": slice(3, 6),
    "ee_pos": slice(6, 8),
    "target_pos": slice(8, 10),
    "target_rel": slice(10, 12),
    "last_action": slice(12, 15),
}
"""Where each term sits in the ``"policy"`` observation row."""
OBS_DIM = 15
ACTION_DIM = 3


@dataclass(frozen=True, kw_only=True)
class TorchReachConfig:
    """The torch reach env: the ``torch_reach`` backend's ``env.options``."""

    device: str = "cpu"
    """Torch device of every tensor: ``cpu`` or ``cuda[:i]``."""
    episode_length: int = 100
    """Steps after which an episode times out (``time_outs``)."""
    dt: float = 0.05
    """Control period (s): 20 Hz."""
    max_joint_vel: float = 2.0
    """Joint velocity (rad/s) an action of 1 commands."""
    success_radius: float = 0.05
    """A fingertip this close to the target (m) succeeds."""
    terminate_on_success: bool = False
    """End an episode (``terminated``) the step its fingertip reaches the target."""
    threads: int = 1
    """Torch intra-op threads of this process when ``device`` is the CPU (0: torch's
    default, one per core). One: the worker shares the CPUs with the gateway and the
    inference server, and spinning thread pools that compete for cores cost far more than
    they gain (45 ms instead of 2 ms a step at 4096 envs on 2 shared cores)."""
    random_start: bool = False
    """Start the first episodes at random ages in ``[0, episode_length)`` (what rsl_rl's
    ``init_at_random_ep_len`` does to Isaac Lab's ``episode_length_buf``), so that envs do
    not all time out on the same step; their first episodes are then shorter."""

    def __post_init__(self) -> None:
        if self.episode_length < 1:
            raise ValueError(f"env.options.episode_length must be >= 1, got {self.episode_length}")
        if not self.dt > 0:
            raise ValueError(f"env.options.dt must be > 0, got {self.dt}")
        if not self.max_joint_vel > 0:
            raise ValueError(f"env.options.max_joint_vel must be > 0, got {self.max_joint_vel}")
        if self.success_radius < 0:
            raise ValueError(f"env.options.success_radius must be >= 0, got {self.success_radius}")
        try:
            device = torch.device(self.device)
        except RuntimeError as exc:
            raise ValueError(f"env.options.device: {exc}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"env.options.device is {self.device!r} but CUDA is not available here")
        if self.threads < 0:
            raise ValueError(f"env.options.threads must be >= 0, got {self.threads}")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"env.options.device must be cpu or cuda[:i], got {self.device!r}")


class TorchReachEnv:
    """``num_envs`` planar reach arms in tensors, with Isaac Lab's RL env interface."""

    def __init__(self, cfg: TorchReachConfig, *, num_envs: int, seed: int = 0) -> None:
        if not isinstance(num_envs, int) or num_envs < 1:
            raise ValueError(f"num_envs must be an int >= 1, got {num_envs!r}")
        self.cfg = cfg
        self.num_envs = num_envs
        self.device = torch.device(cfg.device)
        if self.device.type == "cpu" and cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.max_episode_length = cfg.episode_length
        self.step_dt = cfg.dt
        self._gen = torch.Generator(device=self.device)
        self._gen.manual_seed(seed)
        n, dev = self.num_envs, self.device
        self._links = torch.tensor(LINKS, dtype=torch.float32, device=dev)
        self.joint_pos = torch.zeros(n, 3, device=dev)
        self.joint_vel = torch.zeros(n, 3, device=dev)
        self.target = torch.zeros(n, 2, device=dev)
        self.last_action = torch.zeros(n, ACTION_DIM, device=dev)
        self.episode_length_buf = torch.zeros(n, dtype=torch.long, device=dev)
        self.reset_terminated = torch.zeros(n, dtype=torch.bool, device=dev)
        self.reset_time_outs = torch.zeros(n, dtype=torch.bool, device=dev)
        self._episode_return = torch.zeros(n, device=dev)
        self._episode_success = torch.zeros(n, dtype=torch.bool, device=dev)
        self._obs = torch.zeros(n, OBS_DIM, device=dev)
        self.extras: dict[str, Any] = {}
        self._was_reset = False

    @property
    def unwrapped(self) -> TorchReachEnv:
        """Isaac Lab code reaches the env through ``env.unwrapped`` (gym wrappers)."""
        return self

    @property
    def single_observation_space(self) -> Any:
        from gymnasium import spaces

        box = spaces.Box(-math.inf, math.inf, shape=(OBS_DIM,), dtype="float32")
        return spaces.Dict({"policy": box})

    @property
    def single_action_space(self) -> Any:
        from gymnasium import spaces

        return spaces.Box(-1.0, 1.0, shape=(ACTION_DIM,), dtype="float32")

    # ------------------------------------------------------------------ physics

    def fingertip(self) -> torch.Tensor:
        angles = torch.cumsum(self.joint_pos, dim=1)
        x = (self._links * torch.cos(angles)).sum(dim=1)
        y = (self._links * torch.sin(angles)).sum(dim=1)
        return torch.stack((x, y), dim=1)

    def _sample(self, env_ids: torch.Tensor) -> None:
        k = len(env_ids)
        u = torch.rand(k, 5, generator=self._gen, device=self.device)
        self.joint_pos[env_ids] = (u[:, :3] - 0.5) * 1.0
        self.joint_vel[env_ids] = 0.0
        # Targets on an annulus the arm reaches comfortably.
        radius = 0.3 + 0.45 * u[:, 3]
        angle = (u[:, 4] - 0.5) * 2.0 * math.pi
        self.target[env_ids] = torch.stack((radius * torch.cos(angle), radius * torch.sin(angle)), dim=1)
        self.last_action[env_ids] = 0.0
        self.episode_length_buf[env_ids] = 0
        self._episode_return[env_ids] = 0.0
        self._episode_success[env_ids] = False

    def _observe(self) -> dict[str, torch.Tensor]:
        ee = self.fingertip()
        obs = self._obs
        obs[:, 0:3] = self.joint_pos
        obs[:, 3:6] = self.joint_vel
        obs[:, 6:8] = ee
        obs[:, 8:10] = self.target
        obs[:, 10:12] = self.target - ee
        obs[:, 12:15] = self.last_action
        # A new tensor every step: returned observations are never refilled later.
        return {"policy": obs.clone()}

    # -------------------------------------------------------------- Isaac Lab API

    def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Reset every env; ``seed`` re-seeds the generator first."""
        if seed is not None:
            self._gen.manual_seed(seed)
        self._sample(torch.arange(self.num_envs, device=self.device))
        if self.cfg.random_start:
            self.episode_length_buf[:] = torch.randint(
                0, self.max_episode_length, (self.num_envs,), generator=self._gen, device=self.device
            )
        self.reset_terminated[:] = False
        self.reset_time_outs[:] = False
        self.extras = {}
        return self._observe(), self.extras

    def step(
        self, action: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
        """Advance every env one control period; reset the finished ones in this step."""
        if not isinstance(action, torch.Tensor):
            raise TypeError(f"action must be a torch.Tensor, got {type(action).__name__}")
        if action.shape != (self.num_envs, ACTION_DIM):
            raise ValueError(
                f"action has shape {list(action.shape)}, expected [{self.num_envs}, {ACTION_DIM}]"
            )
        if action.device != self.device:
            raise ValueError(f"action is on {action.device}, the env on {self.device}")
        if not action.is_floating_point():
            raise ValueError(f"action must be a floating-point tensor, got {action.dtype}")
        a = action.to(torch.float32).clamp(-1.0, 1.0)
        self.last_action[:] = a
        self.joint_vel[:] = a * self.cfg.max_joint_vel
        self.joint_pos.add_(self.joint_vel * self.step_dt).clamp_(-JOINT_LIMIT, JOINT_LIMIT)
        distance = torch.linalg.vector_norm(self.target - self.fingertip(), dim=1)
        reward = -distance
        success = distance < self.cfg.success_radius
        self._episode_return += reward
        self._episode_success |= success
        self.episode_length_buf += 1
        # Isaac Lab writes its termination buffers in place every step.
        if self.cfg.terminate_on_success:
            self.reset_terminated[:] = success
        else:
            self.reset_terminated[:] = False
        self.reset_time_outs[:] = (
            self.episode_length_buf >= self.max_episode_length
        ) & ~self.reset_terminated
        done = self.reset_terminated | self.reset_time_outs
        self.extras = {}
        env_ids = done.nonzero(as_tuple=False).squeeze(-1)
        if len(env_ids):
            # Rebuilt only on steps with a reset, as Isaac Lab's managers do.
            self.extras["log"] = {
                "Episode_Reward/distance": (self._episode_return[env_ids] / self.max_episode_length)
                .mean()
                .item(),
                "Metrics/success_rate": self._episode_success[env_ids].float().mean().item(),
                "Episode_Termination/time_out": int(self.reset_time_outs.sum().item()),
                "Episode_Termination/success": int(self.reset_terminated.sum().item()),
            }
            self._sample(env_ids)
        obs = self._observe()
        return obs, reward, self.reset_terminated, self.reset_time_outs, self.extras

    def close(self) -> None:
        """Nothing to release; Isaac Lab envs have it, so callers may call it."""
        return None


class TorchReachBackend(TorchEnvBackend):
    """The torch reach env as the ``torch_reach`` episode backend, through the Isaac Lab
    adapter (:mod:`sim_bridges.batched`), exactly as an Isaac Lab task is served::

        env:
          backend: torch_reach
          num_envs: 4096
          options: {device: cpu, episode_length: 100}
    """

    Config = TorchReachConfig

    def __init__(self, config: TorchReachConfig, *, num_envs: int, seed: int = 0) -> None:
        env = TorchReachEnv(config, num_envs=num_envs, seed=seed)
        meta = {"success_signal": False, "success_radius": config.success_radius, "obs_layout": _layout()}
        super().__init__(env, name="torch_reach", groups={"policy": "policy"}, seed=seed, metadata=meta)


def _layout() -> dict[str, list[int]]:
    return {k: [s.start, s.stop] for k, s in OBS_LAYOUT.items()}
