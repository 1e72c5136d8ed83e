"""Evaluation episodes and policy lag, as the gateway sees them.

:class:`Evaluator` runs evaluation rounds through the same gateway and envs as training:
``evaluate {episodes: N}`` flags the next ``N`` episodes that start (on any env) as
evaluation episodes. Their actions are requested deterministically, their chunks carry
``eval: true`` so no table ever trains on them, and when all ``N`` have ended the round's
success rate (success at an episode's last step) and mean return are published in the
gateway's status and metrics. An evaluation episode that is interrupted (a worker died,
a client reset it) is not counted; another episode takes its place.

:class:`LagTracker` keeps the trainer's newest policy version (``trainer_version``
command) and, for every recorded step, the policy lag: versions behind the trainer, and
seconds since the acting version was superseded. In async mode the gateway stops handing
out actions while the served policy is more than ``max_policy_lag`` versions behind.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway.metrics import Histogram


@dataclass
class EvalRound:
    round_id: int
    requested: int
    started_at_steps: int
    success_signal: bool = True
    """Whether the env reports success; without it the success rate is unknown (None), not 0."""
    assigned: int = 0
    results: list[tuple[bool, float, int]] = field(default_factory=list)
    """(success at the last step, return, lowest policy version that acted)."""

    @property
    def done(self) -> bool:
        return len(self.results) >= self.requested

    def summary(self) -> dict[str, Any]:
        n = len(self.results)
        return {
            "round": self.round_id,
            "episodes": n,
            "requested": self.requested,
            "success_rate": round(sum(r[0] for r in self.results) / n, 4)
            if n and self.success_signal
            else (0.0 if self.success_signal else None),
            "return_mean": round(float(np.mean([r[1] for r in self.results])), 4) if n else 0.0,
            "policy_version": min((r[2] for r in self.results), default=0),
        }


class Evaluator:
    """Assigns evaluation episodes to envs and scores them."""

    def __init__(self) -> None:
        self.round: EvalRound | None = None
        self.success_signal = True
        """Whether the experiment's env reports success (``spec.metadata["success_signal"]``)."""
        self.rounds = 0
        self.history: list[dict[str, Any]] = []
        self._flags: dict[str, np.ndarray] = {}
        self._acc: dict[tuple[str, int], list[float]] = {}

    def request(self, episodes: int, env_steps: int) -> dict[str, Any]:
        if self.round is not None and not self.round.done:
            return {"started": False, "running": self.round.summary()}
        self.rounds += 1
        self.round = EvalRound(self.rounds, episodes, env_steps, self.success_signal)
        return {"started": True, "round": self.rounds, "episodes": episodes}

    @property
    def running(self) -> bool:
        """A round is under way (not all of its episodes have ended)."""
        return self.round is not None and not self.round.done

    def lifts_hold(self, uid: str | None = None) -> bool:
        """Whether the round lets worker ``uid`` step through the sink's backpressure (``None``:
        any worker). While it still hands out episodes, every worker: an env takes one only
        when its current episode ends. After that, only workers with an env in one of its
        episodes. Training episodes beside a round stay paced by the sink: stepped past it,
        they lump data of older policy versions into the replay tables, and collection then
        waits while the trainer uses it up."""
        r = self.round
        if r is None or r.done:
            return False
        if uid is None or r.assigned < r.requested:
            return True
        flags = self._flags.get(uid)
        return flags is not None and bool(np.count_nonzero(flags))

    def flags(self, uid: str, num_envs: int) -> np.ndarray:
        flags = self._flags.get(uid)
        if flags is None or len(flags) != num_envs:
            flags = self._flags[uid] = np.zeros(num_envs, dtype=bool)
        return flags

    def new_episode(self, uid: str, env: int, num_envs: int) -> None:
        flags = self.flags(uid, num_envs)
        r = self.round
        take = r is not None and not r.done and r.assigned < r.requested
        flags[env] = take
        if take:
            assert r is not None
            r.assigned += 1
            self._acc[(uid, env)] = [0.0, 0.0, float("inf")]

    def steps(
        self,
        uid: str,
        rows: np.ndarray,
        reward: np.ndarray,
        success: np.ndarray,
        versions: np.ndarray,
        done: np.ndarray,
        num_envs: int,
    ) -> None:
        """Account the transitions of ``rows``; ``done[j]`` ends row ``j``'s episode."""
        flags = self.flags(uid, num_envs)
        if not np.count_nonzero(flags):
            return
        for j in flags[rows].nonzero()[0].tolist():  # evaluation envs only, not the batch
            env = rows[j]
            acc = self._acc.setdefault((uid, int(env)), [0.0, 0.0, float("inf")])
            acc[0] += float(reward[j])
            acc[1] = float(bool(success[j]))
            acc[2] = min(acc[2], float(versions[j]))
            if done[j]:
                self._finish(uid, int(env), flags)

    def _finish(self, uid: str, env: int, flags: np.ndarray) -> None:
        ret, ok, version = self._acc.pop((uid, env))
        flags[env] = False
        if self.round is not None and not self.round.done:
            self.round.results.append((bool(ok), ret, int(version if np.isfinite(version) else 0)))
            if self.round.done:
                self.history.append({**self.round.summary(), "t": round(time.time(), 3)})

    def interrupted(self, uid: str, env: int | None = None) -> None:
        """Drop evaluation episodes cut short; their slots go back to the round."""
        flags = self._flags.get(uid)
        if flags is None:
            return
        for e in [env] if env is not None else range(len(flags)):
            if flags[e]:
                flags[e] = False
                self._acc.pop((uid, e), None)
                if self.round is not None and not self.round.done:
                    self.round.assigned -= 1

    def forget(self, uid: str) -> None:
        self.interrupted(uid)
        self._flags.pop(uid, None)

    def status(self) -> dict[str, Any]:
        r = self.round
        return {
            "running": self.running,
            "current": r.summary() if r is not None else None,
            "last": self.history[-1] if self.history else None,
            "rounds_done": len(self.history),
        }


class LagTracker:
    """The trainer's version timeline and the lag of every recorded step behind it."""

    def __init__(self) -> None:
        self.trainer_version = 0
        self.max_lag: int | None = None
        self._made: dict[int, float] = {}
        self.versions = Histogram()
        self.seconds = Histogram()

    def report(self, version: int, made_at: float, max_lag: int | None) -> None:
        if version > self.trainer_version:
            self.trainer_version = version
        self._made[version] = made_at
        self.max_lag = max_lag

    def observe(self, versions: np.ndarray, t_action: np.ndarray) -> None:
        if not self.trainer_version:
            return  # no trainer: scripted or frozen policies have no lag to speak of
        # Over the batch with numpy: a 4096-env worker reports 4096 steps a message.
        v, t = np.asarray(versions, np.int64), np.asarray(t_action, np.float64)
        lag = np.maximum(0, self.trainer_version - v)
        self.versions.add_array(lag)
        seconds = np.zeros(len(v))
        for version in np.unique(v).tolist():  # a batch acts with one version or a few
            superseded = self._made.get(int(version) + 1)
            if superseded is not None:
                rows = (v == version) & (lag > 0)
                seconds[rows] = np.maximum(0.0, t[rows] - superseded)
        self.seconds.add_array(seconds)

    def exceeded(self, acting_version: int) -> bool:
        return self.max_lag is not None and self.trainer_version - acting_version > self.max_lag

    def status(self) -> dict[str, Any]:
        return {
            "trainer_version": self.trainer_version,
            "max_policy_lag": self.max_lag,
            "policy_lag": {
                "mean": round(self.versions.mean, 3),
                "p99": self.versions.percentile(99),
                "max": self.versions.max,
                "n": self.versions.n,
            },
            "policy_lag_s": {
                "mean": round(self.seconds.mean, 4),
                "p99": round(self.seconds.percentile(99), 4),
            },
            "policy_lag_hist": lag_counts(self.versions),
        }


def lag_counts(hist: Histogram) -> dict[str, int]:
    """Steps per policy lag (in versions) of a lag histogram: exact for lags up to about 25
    (one log bucket per integer), merged into the bucket's middle value beyond."""
    out: dict[str, int] = {}
    for bucket, count in sorted(hist.counts.items()):
        lag = 0 if bucket == -10_000 else round(Histogram.GROWTH ** (bucket + 0.5))
        out[str(lag)] = out.get(str(lag), 0) + count
    return out
