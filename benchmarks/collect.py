"""Collection throughput: MuJoCo reach envs through the gateway against gymnasium's vector envs.

For N = 1, 4 and 16 envs, three set-ups are built once and measured in turn, once per
repeat (the order rotates from repeat to repeat); while one is measured the others
sit idle (the gateway paused by its ``pause`` command, the vector envs not stepped):

- **collect** (loopgate): the processes ``loopgate up`` starts, planned and supervised by
  the same code (:func:`gateway.supervisor.prepare_run`, :class:`~gateway.supervisor.Supervisor`):
  a gateway running the ``reach_pd`` policy in-process and recording every step (spool
  and local episode store, default settings), plus env workers hosting the
  ``mujoco_reach`` backend. The N envs are split over ``min(N, CPUs)`` workers
  (on 2 CPUs: n1 = 1 worker x 1 env, n4 = 2 x 2, n16 = 2 x 8) so that stepping and
  serving overlap, as one would configure it. Steps/s is the gateway's own count of
  recorded (acknowledged) steps over a window after warm-up.
- **async_vector_env**: ``gymnasium.vector.AsyncVectorEnv`` of N ``loopgate/Reach-v0``
  (:class:`sim_bridges.mujoco.ReachEnv`, same physics and task code), one subprocess
  per env, with the same ``reach_pd`` policy run in the benchmark process.
- **sync_vector_env**: ``gymnasium.vector.SyncVectorEnv`` of the same envs in one process.

Both vector envs use same-step autoreset, as the loopgate backend does, so every
``step`` call is N real transitions. Everything runs on the same CPU set (all CPUs
this process may use). Each measurement discards a warm-up (after the gateway is
resumed, or of stepping) and counts steps over a fixed window; records are medians
over repeats. ``collect_vs_sync.steps_per_s.nN`` repeats the collect figure so it can carry
the SyncVectorEnv baseline::

    loopgate bench --only collect              # or: --only n16
"""

from __future__ import annotations

import logging
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks.procs import available_cpus, describe_cpus
from benchmarks.records import Record

log = logging.getLogger(__name__)

NUM_ENVS = (1, 4, 16)
POLICY = "reach_pd"
TARGETS = {1: ">= 1", 16: ">= 3"}
"""Goals on the ratio to AsyncVectorEnv: one env at least as fast as gymnasium's one
subprocess, 16 envs at least three times as fast."""

NAMES: tuple[str, ...] = tuple(
    name
    for n in NUM_ENVS
    for name in (
        f"collect.steps_per_s.n{n}",
        f"collect_vs_sync.steps_per_s.n{n}",
        f"async_vector_env.steps_per_s.n{n}",
        f"sync_vector_env.steps_per_s.n{n}",
    )
)

START_TIMEOUT_S = 60.0


def _windows(quick: bool) -> tuple[float, float]:
    """(warm-up, measured) seconds of each measurement."""
    return (0.3, 0.6) if quick else (1.0, 3.0)


def split(num_envs: int, cpus: int) -> tuple[int, int]:
    """(workers, envs per worker): one worker per CPU, at most one per env."""
    workers = max(1, min(num_envs, cpus))
    while num_envs % workers:
        workers -= 1
    return workers, num_envs // workers


# ----------------------------------------------------------------------- loopgate


class SupervisedRun:
    """The processes ``loopgate up`` starts for ``cfg``, paused between measured windows.

    Planned and supervised by the same code as ``loopgate up``
    (:func:`gateway.supervisor.prepare_run`, :class:`~gateway.supervisor.Supervisor`).
    Starting them takes seconds, so one run serves every repeat: between measured
    windows the gateway is paused (its ``pause`` command), its workers then wait idle
    for an action, and the baselines are measured without them competing for the CPUs.
    """

    def __init__(
        self,
        cfg: Any,
        run_dir: Path,
        *,
        note: str,
        start_timeout_s: float = START_TIMEOUT_S,
        request_timeout_s: float = 5.0,
    ) -> None:
        from gateway.supervisor import ControlClient, Supervisor, prepare_run

        run, services, _ = prepare_run(cfg, run_dir, "INFO")
        self.supervisor = Supervisor(cfg, run, services)
        self.control = ControlClient(run.endpoints["gateway"]["control"])
        self.workers = int(cfg.env.workers)
        self.note = note
        self.start_timeout_s, self.request_timeout_s = start_timeout_s, request_timeout_s

    def request(self, cmd: str) -> dict[str, Any]:
        return self.control.request(cmd, timeout_s=self.request_timeout_s)

    def _check(self) -> None:
        self.supervisor.supervise()
        if self.supervisor.failed:
            raise RuntimeError(f"loopgate services failed: {self.supervisor.failed}")

    def start(self) -> None:
        """Start the gateway, then the workers, and wait until every worker is stepping."""
        from gateway.protocol import RemoteError, Timeout

        def ready(group: list[Any]) -> bool:
            if any(p.service.name == "gateway" for p in group):
                try:
                    self.control.request("status", timeout_s=0.5)
                except (Timeout, RemoteError):
                    return False
            return True

        self.supervisor.start_all(ready)
        self._check()
        deadline = time.monotonic() + self.start_timeout_s
        log.info("waiting up to %.0f s for %d worker(s) to collect", self.start_timeout_s, self.workers)
        while True:
            self._check()
            s = self.request("status")
            if len(s["workers"]) == self.workers and all(w["env_steps"] > 0 for w in s["workers"]):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"workers did not start collecting within {self.start_timeout_s:.0f} s: {s}"
                )
            time.sleep(0.05)
        self.request("pause")

    def window(self, warmup_s: float, window_s: float) -> tuple[dict[str, Any], dict[str, Any], float]:
        """Collect for ``warmup_s + window_s``: the gateway's status at the window's ends, and its length."""
        self.request("resume")
        try:
            time.sleep(warmup_s)
            t0, s0 = time.perf_counter(), self.request("status")
            time.sleep(window_s)
            t1, s1 = time.perf_counter(), self.request("status")
        finally:
            self.request("pause")
        self._check()
        return s0, s1, t1 - t0

    def measure(self, warmup_s: float, window_s: float) -> float:
        """Recorded steps/s over ``window_s`` after ``warmup_s`` of collecting."""
        s0, s1, seconds = self.window(warmup_s, window_s)
        return float(s1["env_steps"] - s0["env_steps"]) / seconds

    def close(self) -> None:
        self.control.close()
        self.supervisor.stop(timeout_s=10.0)


class CollectRun(SupervisedRun):
    """``num_envs`` reach envs (``mujoco_reach``) with the ``reach_pd`` policy in the gateway."""

    def __init__(self, num_envs: int, run_dir: Path, *, workers: int | None = None) -> None:
        """``num_envs`` split over ``workers`` (default: one worker per CPU, see :func:`split`)."""
        from gateway.config import from_dict

        if workers is None:
            workers, self.per_worker = split(num_envs, len(available_cpus()))
        elif workers < 1 or num_envs % workers:
            raise ValueError(f"{num_envs} envs do not split evenly over {workers} worker(s)")
        else:
            self.per_worker = num_envs // workers
        cfg = from_dict(
            {
                "env": {
                    "backend": "mujoco_reach",
                    "workers": workers,
                    "num_envs": self.per_worker,
                    "seed": 0,
                },
                "policy": {"kind": POLICY},
                "gateway": {"host": "127.0.0.1", "transport": "tcp"},
            },
            name=f"bench-collect-w{workers}e{self.per_worker}",
        )
        note = f"{workers} worker(s) x {self.per_worker} env(s), policy {POLICY} in the gateway"
        super().__init__(cfg, run_dir, note=note)


# --------------------------------------------------------------------- baselines


def _make_reach() -> Any:
    import gymnasium

    import sim_bridges.mujoco  # noqa: F401 - registers loopgate/Reach-v0 (also in forked children)

    return gymnasium.make("loopgate/Reach-v0")


class VectorRun:
    """A gymnasium vector env of ``num_envs`` reach envs and the policy, in this process."""

    def __init__(self, kind: str, num_envs: int) -> None:
        from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv

        from gateway.policies import make_policy
        from sim_bridges.mujoco import MujocoReachConfig

        self.num_envs = num_envs
        self.policy = make_policy(POLICY, MujocoReachConfig().spec(), seed=0)
        cls = AsyncVectorEnv if kind == "async" else SyncVectorEnv
        self.envs = cls([_make_reach] * num_envs, autoreset_mode=AutoresetMode.SAME_STEP)
        self.obs, _ = self.envs.reset(seed=0)

    def measure(self, warmup_s: float, window_s: float) -> float:
        """Env steps/s over ``window_s`` after ``warmup_s`` of stepping."""
        envs, act = self.envs, self.policy.act
        obs = self.obs
        end = time.perf_counter() + warmup_s
        while time.perf_counter() < end:
            obs, *_ = envs.step(act(obs))
        steps = 0
        t0 = time.perf_counter()
        end = t0 + window_s
        while True:
            obs, *_ = envs.step(act(obs))
            steps += 1
            now = time.perf_counter()
            if now >= end:
                break
        self.obs = obs
        return steps * self.num_envs / (now - t0)

    def close(self) -> None:
        self.envs.close()


def interleave(
    runners: dict[str, Any],
    values: dict[str, list[float]],
    repeats: int,
    warmup_s: float,
    window_s: float,
    what: str,
) -> None:
    """Measure every runner ``repeats`` times into ``values[kind]``, the order rotating from
    repeat to repeat so that no set-up always runs first (or last) on the shared CPUs."""
    kinds = list(runners)
    for rep in range(repeats):
        shift = rep % len(kinds)
        for kind in kinds[shift:] + kinds[:shift]:
            values[kind].append(runners[kind].measure(warmup_s, window_s))
            log.info("%s %s repeat %d: %.0f steps/s", what, kind, rep + 1, values[kind][-1])


# -------------------------------------------------------------------------- suite


def run(quick: bool, repeats: int) -> list[Record]:
    """Measure every N ``repeats`` times, loopgate and both baselines interleaved."""
    # Every process measured here inherits this process's CPU set: the same for all.
    cpus = available_cpus()
    warmup_s, window_s = _windows(quick)
    placement = f"all on cpus {describe_cpus(set(cpus))}"
    records: list[Record] = []
    for n in NUM_ENVS:
        values: dict[str, list[float]] = {"collect": [], "async": [], "sync": []}
        with tempfile.TemporaryDirectory(prefix="loopgate-bench-collect-") as tmp, ExitStack() as stack:
            gateway = CollectRun(n, Path(tmp) / "run")
            stack.callback(gateway.close)
            gateway.start()
            runners: dict[str, Any] = {"collect": gateway}
            for kind in ("async", "sync"):
                runners[kind] = VectorRun(kind, n)
                stack.callback(runners[kind].close)
            interleave(runners, values, repeats, warmup_s, window_s, f"n{n}")
            collect_note = gateway.note
        timing = f"median of {repeats} x {window_s:g} s after {warmup_s:g} s warm-up, {placement}"
        a_name, s_name = f"async_vector_env.steps_per_s.n{n}", f"sync_vector_env.steps_per_s.n{n}"
        vec_note = f"{n} env(s), same-step autoreset, policy {POLICY} in-process; {timing}"
        target = TARGETS.get(n)
        records += [
            Record.median_of(a_name, values["async"], "steps/s", note=f"one process per env; {vec_note}"),
            Record.median_of(s_name, values["sync"], "steps/s", note=f"one process; {vec_note}"),
            Record.median_of(
                f"collect.steps_per_s.n{n}",
                values["collect"],
                "steps/s",
                baseline=a_name,
                note=f"{collect_note}; {timing}",
                target=target,
            ),
            Record.median_of(
                f"collect_vs_sync.steps_per_s.n{n}",
                values["collect"],
                "steps/s",
                baseline=s_name,
                note=f"{collect_note}; {timing}",
            ),
        ]
    return records
