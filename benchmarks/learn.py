"""Time to 80 % success: the main job against a plain single-process SAC, back to back.

- ``learn.time_to_80_s``: ``loopgate up configs/reach_sim.yaml`` (every service on this
  machine: env workers, gateway, inference server, replay service, the FSDP trainer)
  from the command to the end of the first evaluation round whose success rate reaches
  80 % (the round's own end time, as the gateway's records in the run's ``metrics.jsonl``
  give it, not when the next record was written or read); the run is then stopped
  (SIGINT, graceful). Baseline: ``sac_single.time_to_80_s``.
- ``sac_single.time_to_80_s``: from its command too (``python -m benchmarks.learn``, a
  process of its own: its interpreter, torch and MuJoCo start inside the time as the
  main job's services do); ``sac_single.time_to_80_in_process_s`` from its first line of
  work after those imports. The same task (``mujoco_reach``, the config's options
  and env count), the same networks (``inference.network``; critic as the trainer
  builds it), the same SAC (``trainer.algos.sac``, the config's options), the same
  batch size, replay warm-up (``min_size_to_sample``) and update-to-data ratio
  (``samples_per_insert`` / ``batch_size`` updates per env step), the same evaluation
  (``eval_episodes`` deterministic episodes every ``eval_every`` updates), all in one
  process, one loop: step every env, store, update when due, evaluate when due.
- ``learn.env_steps_to_80`` / ``sac_single.env_steps_to_80`` and ``*.updates_to_80``:
  where each one got there.

The ratio says how much faster the whole loop is (``<= 1``: no slower). A run that
does not reach 80 % within ``BUDGET_S`` counts the budget and where it got by then
(and the note says how many runs reached the bar).
``--quick`` lowers the bar to 30 % so the suite can be smoke-tested in minutes::

    loopgate bench --only time_to_80
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.procs import REPO, tied
from benchmarks.records import Record

log = logging.getLogger(__name__)

CONFIG = REPO / "configs" / "reach_sim.yaml"
THRESHOLD, QUICK_THRESHOLD = 0.8, 0.3
BUDGET_S = 1200.0
NAMES: tuple[str, ...] = (
    *(
        f"{who}.{what}"
        for who in ("learn", "sac_single")
        for what in ("time_to_80_s", "env_steps_to_80", "updates_to_80")
    ),
    "sac_single.time_to_80_in_process_s",
)


def _reached(record: dict[str, Any], threshold: float) -> float | None:
    """When (wall clock) the evaluation round in ``record`` ended, if it reached ``threshold``."""
    last = (record.get("eval") or {}).get("last") or {}
    rate = last.get("success_rate")
    if rate is None or float(rate) < threshold:
        return None
    return float(last.get("t") or time.time())


def main_job(threshold: float, budget_s: float, tmp: Path) -> dict[str, float]:
    """``loopgate up`` until an evaluation round reaches ``threshold``; then SIGINT."""
    run_dir = tmp / "main-job"
    tmp.mkdir(parents=True, exist_ok=True)
    out = open(tmp / "main-job.log", "wb")  # noqa: SIM115 - closed below, after the process
    t0 = time.monotonic()
    started = time.time()  # wall clock: the gateway stamps a round's end on the same clock
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "up", str(CONFIG), "--run-dir", str(run_dir)],
        cwd=REPO,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        **tied(),
    )
    result = {"time_s": budget_s, "env_steps": 0.0, "updates": 0.0, "reached": 0.0}
    offset = 0
    metrics = run_dir / "metrics.jsonl"
    try:
        log.info(
            "main job: waiting for an evaluation round at %.0f %% (at most %.0f s)", 100 * threshold, budget_s
        )
        while time.monotonic() - t0 < budget_s and proc.poll() is None:
            time.sleep(0.5)
            if not metrics.exists():
                continue
            with open(metrics, "rb") as f:
                f.seek(offset)
                chunk = f.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]
            offset += len(complete)
            for line in complete.splitlines():
                row = json.loads(line)
                if row.get("service") == "trainer" and "updates" in row:
                    result["updates"] = float(row["updates"])
                if row.get("service") == "gateway" and "env_steps" in row:
                    result["env_steps"] = float(row["env_steps"])
                    ended = _reached(row, threshold)
                    if ended is not None:
                        result.update(time_s=ended - started, reached=1.0)
                        return result
        if proc.poll() is not None:
            log.warning("main job ended (exit %s) before reaching %.0f %%", proc.returncode, 100 * threshold)
        return result
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                log.warning("main job did not stop within 120 s of SIGINT; killing it")
                proc.kill()
                proc.wait()
        out.close()


class Buffer:
    """A uniform ring buffer of transitions, as plain as a single-process SAC has it."""

    def __init__(self, spec: Any, size: int) -> None:
        self.size, self.n, self.i = size, 0, 0
        self.obs = {k: np.zeros((size, *a.shape), a.dtype) for k, a in spec.observation.items()}
        self.next_obs = {k: np.zeros_like(v) for k, v in self.obs.items()}
        self.action = np.zeros((size, *spec.action.shape), np.float32)
        self.reward = np.zeros(size, np.float32)
        self.terminated = np.zeros(size, np.float32)

    def add(self, obs: Any, action: Any, reward: Any, next_obs: Any, terminated: Any) -> None:
        rows = (self.i + np.arange(len(reward))) % self.size
        for k in self.obs:
            self.obs[k][rows] = obs[k]
            self.next_obs[k][rows] = next_obs[k]
        self.action[rows], self.reward[rows], self.terminated[rows] = action, reward, terminated
        self.i = int((rows[-1] + 1) % self.size)
        self.n = min(self.n + len(reward), self.size)

    def sample(self, batch: int, rng: np.random.Generator) -> dict[str, Any]:
        import torch

        idx = rng.integers(0, self.n, batch)
        out = {f"obs/{k}": torch.from_numpy(v[idx]) for k, v in self.obs.items()}
        out.update({f"next_obs/{k}": torch.from_numpy(v[idx]) for k, v in self.next_obs.items()})
        out.update(
            action=torch.from_numpy(self.action[idx]),
            reward=torch.from_numpy(self.reward[idx]),
            terminated=torch.from_numpy(self.terminated[idx]),
        )
        return out


def evaluate(actor: Any, backend: Any, episodes: int, seed: int) -> float:
    """Success rate at the last step of one deterministic episode per env."""
    import torch

    obs, _ = backend.reset(seed=seed)
    done = np.zeros(episodes, bool)
    success = np.zeros(episodes, bool)
    with torch.no_grad():
        while not done.all():
            t = {k: torch.from_numpy(v) for k, v in obs.items()}
            action = actor(t, torch.zeros(episodes, actor.action_dim)).numpy()
            obs, _, term, trunc, info = backend.step(action)
            ended = (term | trunc) & ~done
            success[ended] = np.asarray(info["success"])[ended]
            done |= ended
    return float(success.mean())


def sac_single(threshold: float, budget_s: float, seed: int = 0) -> dict[str, float]:
    """One process, one loop: the main job's task, networks and ratios without loopgate."""
    import torch

    from gateway.config import load_config
    from gateway.factory import make_backend
    from trainer.algos import make_algorithm

    cfg = load_config(CONFIG)
    tc, env = cfg.trainer, cfg.env
    table = next(t for t in cfg.replay.tables if t.name == "online")
    envs = env.workers * env.num_envs
    t0 = time.monotonic()
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    train = make_backend(env.backend, num_envs=envs, seed=seed, options=dict(env.options))
    evals = make_backend(
        env.backend, num_envs=tc.eval_episodes, seed=seed + 10_000, options=dict(env.options)
    )
    spec = train.spec
    algo = make_algorithm(
        tc.algorithm, spec, cfg.inference.network, dict(tc.options), device=torch.device("cpu")
    )
    algo.build_optimizers()
    buffer = Buffer(spec, table.max_size)
    rng = np.random.default_rng(seed)
    updates_per_step = float(table.samples_per_insert or tc.batch_size) / tc.batch_size
    obs, _ = train.reset(seed=seed)
    steps = updates = 0
    rounds = 0
    while time.monotonic() - t0 < budget_s:
        with torch.no_grad():
            action, _ = algo.actor.sample({k: torch.from_numpy(v) for k, v in obs.items()})
        action = action.numpy()
        next_obs, reward, term, trunc, info = train.step(action)
        ended = term | trunc
        stored_next = {k: v.copy() for k, v in next_obs.items()}
        if ended.any():
            for k, v in info["final_obs"].items():
                stored_next[k][ended] = v[ended]
        buffer.add(obs, action, reward, stored_next, term.astype(np.float32))
        obs, steps = next_obs, steps + envs
        if buffer.n < table.min_size_to_sample:
            continue
        while updates < (steps - table.min_size_to_sample) * updates_per_step:
            algo.update(buffer.sample(tc.batch_size, rng))
            updates += 1
            if tc.eval_every and updates % tc.eval_every == 0:
                rounds += 1
                rate = evaluate(algo.actor, evals, tc.eval_episodes, seed + rounds)
                log.info("sac_single: %d updates, %d env steps: success %.0f %%", updates, steps, 100 * rate)
                if rate >= threshold:
                    train.close()
                    evals.close()
                    return {
                        "time_s": time.monotonic() - t0,
                        "reached_at": time.time(),
                        "env_steps": steps,
                        "updates": updates,
                        "reached": 1.0,
                    }
    train.close()
    evals.close()
    return {"time_s": budget_s, "env_steps": float(steps), "updates": float(updates), "reached": 0.0}


def sac_single_command(threshold: float, budget_s: float, seed: int, tmp: Path) -> dict[str, float]:
    """:func:`sac_single` in a process of its own, timed from its command like the main job."""
    tmp.mkdir(parents=True, exist_ok=True)
    started = time.time()  # wall clock: the child reports when it got there on the same clock
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.learn", str(threshold), str(budget_s), str(seed)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=budget_s + 120,
        **tied(),
    )
    (tmp / "sac-single.log").write_text(done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"sac_single failed (exit {done.returncode}): {done.stderr[-2000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    in_process = result["time_s"]
    if result["reached"]:
        result["time_s"] = result.pop("reached_at") - started
    result["in_process_s"] = in_process
    return result


def run(quick: bool, repeats: int) -> list[Record]:
    threshold = QUICK_THRESHOLD if quick else THRESHOLD
    runs = 1 if quick else max(1, min(repeats, 2))  # minutes each: at most two pairs
    got: dict[str, list[dict[str, float]]] = {"learn": [], "sac_single": []}
    with tempfile.TemporaryDirectory(prefix="loopgate-bench-learn-") as tmp:
        for rep in range(runs):
            order = ["learn", "sac_single"] if rep % 2 == 0 else ["sac_single", "learn"]
            for who in order:
                if who == "learn":
                    got[who].append(main_job(threshold, BUDGET_S, Path(tmp) / f"rep{rep}"))
                else:
                    got[who].append(sac_single_command(threshold, BUDGET_S, rep, Path(tmp) / f"rep{rep}"))
                log.info("%s repeat %d: %s", who, rep + 1, got[who][-1])
    bar = f"{100 * threshold:.0f} % evaluation success"
    notes = {
        who: f"to {bar}; {sum(r['reached'] for r in rs):.0f} of {len(rs)} runs reached it within {BUDGET_S:.0f} s"
        for who, rs in got.items()
    }
    notes["learn"] += " (loopgate up configs/reach_sim.yaml)"
    notes["sac_single"] += " (one process: same task, networks, SAC, batch and update-to-data ratio)"
    records: list[Record] = []
    for what, key, unit in (
        ("time_to_80_s", "time_s", "s"),
        ("env_steps_to_80", "env_steps", "steps"),
        ("updates_to_80", "updates", "updates"),
    ):
        base = f"sac_single.{what}"
        records.append(
            Record.median_of(base, [r[key] for r in got["sac_single"]], unit, note=notes["sac_single"])
        )
        if what == "time_to_80_s":
            records.append(
                Record.median_of(
                    "sac_single.time_to_80_in_process_s",
                    [r["in_process_s"] for r in got["sac_single"]],
                    unit,
                    note="the same runs from their first line of work, after the imports",
                )
            )
        records.append(
            Record.median_of(
                f"learn.{what}",
                [r[key] for r in got["learn"]],
                unit,
                baseline=base,
                note=notes["learn"],
                target="<= 1" if what == "time_to_80_s" else None,
            )
        )
    return records


if __name__ == "__main__":  # sac_single_command's process: THRESHOLD BUDGET_S SEED -> one JSON line
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    print(json.dumps(sac_single(float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]))))
