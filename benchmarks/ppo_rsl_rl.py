"""rsl_rl's own PPO on an mjlab task, for ``benchmarks.ppo``: run in mjlab's venv.

Imports nothing of loopgate (mjlab's venv has mjlab, rsl_rl and torch, not loopgate's
dependencies). mjlab's PPO runner config for the task (``load_rl_cfg``) with the
benchmark's overrides (env count, steps per env, network, PPO options, iterations) trains
with ``OnPolicyRunner.learn`` unchanged; a wrapper around mjlab's ``RslRlVecEnvWrapper``
records each finished episode's return and wall-clock time. Prints one JSON line::

    WARP_CACHE_PATH=.venv-mjlab/warp-cache CUDA_VISIBLE_DEVICES= \
      .venv-mjlab/bin/python benchmarks/ppo_rsl_rl.py '{"task": "Mjlab-Cartpole-Balance", ...}'
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from typing import Any


def main(argv: list[str] | None = None) -> int:
    args = json.loads((argv if argv is not None else sys.argv[1:])[0])
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    t0 = time.time()
    import torch
    from mjlab.envs import ManagerBasedRlEnv
    from mjlab.rl import RslRlVecEnvWrapper
    from mjlab.rl.runner import MjlabOnPolicyRunner
    from mjlab.tasks.registry import load_env_cfg, load_rl_cfg

    torch.set_num_threads(int(args.get("threads", 1)))
    torch.manual_seed(int(args.get("seed", 0)))
    task = args["task"]
    env_cfg = load_env_cfg(task)
    env_cfg.scene.num_envs = int(args["num_envs"])
    env_cfg.seed = int(args.get("seed", 0))
    step_dt = env_cfg.sim.mujoco.timestep * env_cfg.decimation
    env_cfg.episode_length_s = (int(args["max_episode_steps"]) - 0.5) * step_dt  # as loopgate's backend
    env = ManagerBasedRlEnv(env_cfg, device="cpu")
    episodes: list[tuple[float, float]] = []

    class Recording(RslRlVecEnvWrapper):
        """Finished episodes' (unix time, return, env steps so far)."""

        def step(self, actions: torch.Tensor) -> Any:
            obs, rew, dones, extras = super().step(actions)
            self._ret += rew
            self._steps += self.num_envs
            done = dones.bool()
            if done.any():
                now = time.time()
                episodes.extend((now, float(r), self._steps) for r in self._ret[done].tolist())
                self._ret[done] = 0.0
            return obs, rew, dones, extras

    vec = Recording(env, clip_actions=args.get("clip_actions"))
    vec._ret = torch.zeros(vec.num_envs)
    vec._steps = 0
    cfg = load_rl_cfg(task)
    cfg.num_steps_per_env = int(args["steps_per_env"])
    cfg.actor.hidden_dims = tuple(args["hidden"])
    cfg.critic.hidden_dims = tuple(args["hidden"])
    cfg.actor.activation = cfg.critic.activation = args["activation"]
    cfg.obs_groups = {"actor": ("actor",), "critic": ("actor",)}  # loopgate's critic sees the actor's obs
    for key, value in args["algorithm"].items():
        setattr(cfg.algorithm, key, value)
    cfg.logger = "tensorboard"
    train_cfg = asdict(cfg)
    runner = MjlabOnPolicyRunner(vec, train_cfg, log_dir=None, device="cpu")
    started = time.time()
    runner.learn(num_learning_iterations=int(args["iterations"]))
    print(
        json.dumps(
            {
                "t_launch": t0,
                "t_train": started,
                "t_end": time.time(),
                "episodes": episodes,
                "env_steps": int(args["iterations"]) * cfg.num_steps_per_env * vec.num_envs,
            }
        ),
        flush=True,
    )
    env.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
