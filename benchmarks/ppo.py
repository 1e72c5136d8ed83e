"""Time to a return: loopgate's PPO through the whole loop against rsl_rl's own PPO, back to back.

The same mjlab task (``Mjlab-Cartpole-Balance`` on the CPU, 200-step episodes, actions
bounded to [-1, 1]), the same env count, the same networks (actor and critic MLPs of the
task's rsl_rl config: 64 x 64, ELU; both critics see the actor's observations; both
policies start with std 1), the same
PPO options (mjlab's rsl_rl config for the task: 5 epochs x 4 minibatches, lr 1e-3
adaptive, γ 0.99, λ 0.95, clip 0.2, entropy 0.01) and the same steps per env per round,
for the same number of rounds:

- ``ppo.time_to_return_s``: ``loopgate up`` (the mjlab worker in mjlab's venv, gateway,
  inference server, replay service, the PPO trainer in sync mode), from the command to
  the first moment the mean return of the last ``num_envs`` finished training episodes
  reaches ``RETURN``; read afterwards from the episodes the run stored. Baseline:
- ``rsl_rl.time_to_return_s``: ``rsl_rl.runners.OnPolicyRunner`` on mjlab's
  ``RslRlVecEnvWrapper`` in mjlab's venv (``benchmarks/ppo_rsl_rl.py``), from the command
  to the same moment, from the episodes it finished.
- ``ppo.env_steps_to_return`` / ``rsl_rl.env_steps_to_return``: where each got there.

Differences that remain: loopgate's actor is a tanh-squashed Gaussian with a
state-dependent std (what its inference servers serve), rsl_rl's a Gaussian with one
learned std; loopgate drops each round's steps that reach it a version late (see
``docs/trainer.md``). A run that never reaches the return counts its whole duration and
says so in the note. ``--quick`` runs fewer rounds to a lower return::

    loopgate bench --only time_to_return
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.procs import REPO, tied
from benchmarks.records import Record

log = logging.getLogger(__name__)

NAMES: tuple[str, ...] = tuple(
    f"{who}.{what}" for who in ("ppo", "rsl_rl") for what in ("time_to_return_s", "env_steps_to_return")
)

TASK = "Mjlab-Cartpole-Balance"
NUM_ENVS, STEPS_PER_ENV, EPISODE_STEPS = 64, 32, 200
HIDDEN, ACTIVATION = (64, 64), "elu"
LOG_STD_SPAN = 2.0
"""The actor's log-std bounds ±2: it starts near 0 (std 1, rsl_rl's ``init_std`` for the task)."""
RETURN, QUICK_RETURN = 4.0, 3.0
"""Mean return of the last ``NUM_ENVS`` finished episodes (mjlab scales rewards by the step: at most 10)."""
ROUNDS, QUICK_ROUNDS = 120, 40
BUDGET_S = 1800.0
MJLAB_PYTHON = REPO / ".venv-mjlab" / "bin" / "python"
PPO = {  # mjlab's rsl_rl config of the task, in loopgate's names
    "gamma": 0.99,
    "gae_lambda": 0.95,
    "clip": 0.2,
    "value_clip": 0.2,
    "epochs": 5,
    "minibatches": 4,
    "lr": 1e-3,
    "schedule": "adaptive",
    "desired_kl": 0.01,
    "entropy_coef": 0.01,
    "value_coef": 1.0,
    "max_grad_norm": 1.0,
}


def env_vars() -> dict[str, str]:
    return {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "WARP_CACHE_PATH": os.environ.get("WARP_CACHE_PATH", str(REPO / ".venv-mjlab" / "warp-cache")),
    }


def loopgate_config(rounds: int) -> dict[str, Any]:
    collect = STEPS_PER_ENV * NUM_ENVS
    return {
        "env": {
            "backend": "mjlab",
            "python": str(MJLAB_PYTHON),
            "workers": 1,
            "num_envs": NUM_ENVS,
            "seed": 0,
            "options": {
                "task": TASK,
                "device": "cpu",
                "groups": {"actor": "policy"},
                "clip_actions": 1.0,
                "max_episode_steps": EPISODE_STEPS,
            },
        },
        "policy": {"kind": "inference"},
        "gateway": {"host": "127.0.0.1", "transport": "tcp", "chunk_steps": 8},
        "inference": {
            "enabled": True,
            "backend": "torch",
            "deterministic": False,
            # log_std midway between the bounds: an initial std of 1, as rsl_rl's init_std.
            "network": {
                "hidden_sizes": list(HIDDEN),
                "activation": ACTIVATION,
                "log_std_min": -LOG_STD_SPAN,
                "log_std_max": LOG_STD_SPAN,
            },
        },
        "replay": {
            "enabled": True,
            "tables": [
                {
                    "name": "rollout",
                    "item": "transition",
                    "sampler": "fifo",
                    "max_times_sampled": 1,
                    "links": True,
                    "gamma": PPO["gamma"],
                    "max_size": 4 * collect,
                }
            ],
        },
        "trainer": {
            "enabled": True,
            "algorithm": "ppo",
            "options": {**PPO, "rollout_steps": STEPS_PER_ENV},
            "nproc": 1,
            "tables": {"rollout": 1.0},
            "mode": "sync",
            "collect_steps": collect,
            "eval_every": 0,
            "final_eval_episodes": 0,
            "checkpoint_every": 100_000,
            "max_updates": rounds * PPO["epochs"] * PPO["minibatches"],
        },
        "run": {"max_env_steps": (rounds + 2) * collect},
    }


def reached(episodes: list[tuple[float, float]], target: float, since: float) -> float | None:
    """Seconds from ``since`` until the mean of the last ``NUM_ENVS`` finished returns is >= target."""
    episodes = sorted(episodes)
    for i in range(NUM_ENVS, len(episodes) + 1):
        if np.mean([r for _, r in episodes[i - NUM_ENVS : i]]) >= target:
            return episodes[i - 1][0] - since
    return None


def run_loopgate(rounds: int, target: float, tmp: Path) -> dict[str, float]:
    import yaml

    from trainer.replay.export import run_episodes

    tmp.mkdir(parents=True, exist_ok=True)
    path, run_dir = tmp / "ppo.yaml", tmp / "run"
    path.write_text(yaml.safe_dump(loopgate_config(rounds)))
    t0 = time.time()
    with open(tmp / "up.log", "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "up", str(path), "--run-dir", str(run_dir)],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **tied(env_vars()),
        )
        try:
            proc.wait(timeout=BUDGET_S)
        except subprocess.TimeoutExpired:
            log.warning("loopgate ppo: still running after %.0f s; stopping it", BUDGET_S)
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)
    end = time.time()
    finished, acted = [], []
    for ep in run_episodes(run_dir, evals=False):
        t = ep.arrays["t_action"]
        acted.append(t)
        if ep.end not in ("terminated", "truncated"):
            continue
        step = float(np.median(np.diff(t))) if len(t) > 1 else 0.0  # the env's last step, after the action
        finished.append((float(t[-1]) + step, float(ep.arrays["reward"].sum())))
    times = np.sort(np.concatenate(acted)) if acted else np.zeros(0)
    return summarise("loopgate ppo", finished, target, t0, end, lambda t: float(np.searchsorted(times, t)))


def run_rsl_rl(rounds: int, target: float, seed: int) -> dict[str, float]:
    args = {
        "task": TASK,
        "num_envs": NUM_ENVS,
        "max_episode_steps": EPISODE_STEPS,
        "steps_per_env": STEPS_PER_ENV,
        "hidden": list(HIDDEN),
        "activation": ACTIVATION,
        "clip_actions": 1.0,
        "iterations": rounds,
        "seed": seed,
        "algorithm": {
            "gamma": PPO["gamma"],
            "lam": PPO["gae_lambda"],
            "clip_param": PPO["clip"],
            "num_learning_epochs": PPO["epochs"],
            "num_mini_batches": PPO["minibatches"],
            "learning_rate": PPO["lr"],
            "schedule": PPO["schedule"],
            "desired_kl": PPO["desired_kl"],
            "entropy_coef": PPO["entropy_coef"],
            "value_loss_coef": PPO["value_coef"],
            "max_grad_norm": PPO["max_grad_norm"],
            "use_clipped_value_loss": True,
        },
    }
    t0 = time.time()
    # -P: the script's folder (benchmarks/, with its own mjlab.py) must not shadow mjlab.
    done = subprocess.run(
        [str(MJLAB_PYTHON), "-P", str(REPO / "benchmarks" / "ppo_rsl_rl.py"), json.dumps(args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=BUDGET_S,
        **tied(env_vars()),
    )
    if done.returncode != 0:
        raise RuntimeError(f"rsl_rl run failed (exit {done.returncode}): {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    finished = [(float(t), float(r)) for t, r, _ in result["episodes"]]
    counted = sorted((float(t), float(n)) for t, _, n in result["episodes"])
    marks, totals = np.array([t for t, _ in counted]), np.array([n for _, n in counted])

    def steps_at(t: float) -> float:
        i = int(np.searchsorted(marks, t, side="right"))
        return float(totals[i - 1]) if i else 0.0

    return summarise("rsl_rl", finished, target, t0, time.time(), steps_at)


def summarise(
    who: str,
    finished: list[tuple[float, float]],
    target: float,
    t0: float,
    end: float,
    steps_at: Callable[[float], float],
) -> dict[str, float]:
    got = reached(finished, target, t0)
    finished.sort()
    last = float(np.mean([r for _, r in finished[-NUM_ENVS:]])) if finished else 0.0
    at = t0 + got if got is not None else end
    result = {
        "time_s": at - t0,
        "reached": float(got is not None),
        "env_steps": steps_at(at),
        "final_return": last,
        "episodes": float(len(finished)),
    }
    log.info("%s: %s", who, result)
    return result


def run(quick: bool, repeats: int) -> list[Record]:
    if not MJLAB_PYTHON.exists():
        log.warning("no %s (make install creates it): the ppo suite needs mjlab's venv", MJLAB_PYTHON)
        return []
    rounds, target = (QUICK_ROUNDS, QUICK_RETURN) if quick else (ROUNDS, RETURN)
    runs = 1 if quick else max(1, min(repeats, 2))  # many minutes each
    got: dict[str, list[dict[str, float]]] = {"ppo": [], "rsl_rl": []}
    with tempfile.TemporaryDirectory(prefix="loopgate-bench-ppo-") as tmp:
        for rep in range(runs):
            for who in ("ppo", "rsl_rl") if rep % 2 == 0 else ("rsl_rl", "ppo"):
                if who == "ppo":
                    got[who].append(run_loopgate(rounds, target, Path(tmp) / f"rep{rep}"))
                else:
                    got[who].append(run_rsl_rl(rounds, target, seed=rep))
    bar = f"mean return {target} of the last {NUM_ENVS} training episodes ({TASK}, {NUM_ENVS} envs)"
    notes = {
        who: f"to {bar}; {sum(r['reached'] for r in rs):.0f} of {len(rs)} runs reached it in {rounds} rounds; "
        f"final returns {[round(r['final_return'], 2) for r in rs]}"
        for who, rs in got.items()
    }
    notes["ppo"] += " (loopgate up: mjlab worker, gateway, inference, replay, PPO trainer)"
    notes["rsl_rl"] += " (rsl_rl OnPolicyRunner, one process, same task, networks, options)"
    records: list[Record] = []
    for what, key, unit in (
        ("time_to_return_s", "time_s", "s"),
        ("env_steps_to_return", "env_steps", "steps"),
    ):
        base = f"rsl_rl.{what}"
        records.append(Record.median_of(base, [r[key] for r in got["rsl_rl"]], unit, note=notes["rsl_rl"]))
        records.append(
            Record.median_of(
                f"ppo.{what}", [r[key] for r in got["ppo"]], unit, baseline=base, note=notes["ppo"]
            )
        )
    return records
