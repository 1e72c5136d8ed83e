"""A performance model of collection: steps/s from per-message costs measured in runs.

An env worker is a closed loop. Each message it sends carries one step of its
``num_envs`` envs, and its next message leaves only after the action came back. One
message costs

- ``env_us``: the backend stepping the worker's envs (the workers' ``env_step`` hop);
- ``gateway_us``: the gateway's busy time for it (its loop's ``busy_s`` over the
  messages it handled): decoding, the policy, recording, spooling, answering;
- ``overhead_us``: the rest of one worker's cycle, measured with one worker alone
  (cycle time minus the two above): encoding and the transits through ZeroMQ.

Each cost is a line in the env count per message (the "batch-size curve"), fitted over
the calibration runs (:meth:`Model.fit`). For ``workers`` x ``num_envs`` envs on
``cpus`` CPUs, the model predicts the lowest of three limits, in messages per second:

- the workers' closed loops: ``workers / cycle``, cycle = env + gateway + overhead;
- the CPUs: ``cpus / cycle`` (every microsecond of a cycle is some process's CPU time);
- the gateway's one loop: ``1 / gateway_us``,

times ``num_envs`` steps per message. It names the limit it took, which is the stage to
speed up. ``loopgate bench --only model`` checks it: calibrated on two shapes, it
predicts others that it then measures (:mod:`benchmarks.model`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gateway.metrics import read_metrics


@dataclass(frozen=True)
class Point:
    """Per-message costs measured in one run (µs), with its shape and throughput."""

    workers: int
    num_envs: int
    steps_per_s: float
    env_us: float
    gateway_us: float
    overhead_us: float | None
    """Known only for one-worker runs, whose cycle has no queueing behind another worker."""


def point_from_records(
    records: list[dict[str, Any]],
    *,
    workers: int,
    num_envs: int,
    since: float = 0.0,
    until: float = float("inf"),
) -> Point:
    """The costs of one run from the gateway's ``metrics.jsonl`` records in [since, until].

    ``since`` and ``until`` are wall-clock times (the records' ``t``): leave the warm-up out.
    """
    rows = [
        r for r in records if r.get("service") == "gateway" and "env_steps" in r and since <= r["t"] <= until
    ]
    if len(rows) < 2:
        raise ValueError(f"need two gateway metrics records in the measured window, got {len(rows)}")
    first, last = rows[0], rows[-1]
    seconds = float(last["t"] - first["t"])
    steps = float(last["env_steps"] - first["env_steps"])
    if seconds <= 0 or steps <= 0:
        raise ValueError("the gateway recorded no steps in the measured window")
    messages = steps / num_envs
    gateway_us = 1e6 * float(last["busy_s"] - first["busy_s"]) / messages
    env_us = float(last.get("hops_us", {}).get("env_step", {}).get("p50", 0.0))
    overhead = None
    if workers == 1:
        cycle_us = 1e6 * seconds / messages
        overhead = max(cycle_us - env_us - gateway_us, 0.0)
    return Point(workers, num_envs, steps / seconds, env_us, gateway_us, overhead)


def point_from_run(run_dir: Path, since: float = 0.0, until: float = float("inf")) -> Point:
    """:func:`point_from_records` for a run folder (its shape from ``config.yaml``)."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    env = cfg.get("env", {})
    return point_from_records(
        read_metrics(run_dir / "metrics.jsonl"),
        workers=int(env.get("workers", 1)),
        num_envs=int(env.get("num_envs", 1)),
        since=since,
        until=until,
    )


@dataclass(frozen=True)
class Line:
    """``intercept + slope * num_envs`` (µs per message)."""

    intercept: float
    slope: float

    def at(self, num_envs: int) -> float:
        return max(self.intercept + self.slope * num_envs, 0.0)

    @classmethod
    def fit(cls, xs: list[float], ys: list[float], *, proportional: bool) -> Line:
        """Least squares; with one point, proportional (``y = b x``) or constant."""
        if not xs:
            raise ValueError("no calibration points")
        if len(set(xs)) < 2:
            mean_y = sum(ys) / len(ys)
            return cls(0.0, mean_y / xs[0]) if proportional else cls(mean_y, 0.0)
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        return cls(my - slope * mx, slope)


@dataclass(frozen=True)
class Prediction:
    steps_per_s: float
    limit: str
    """Which limit set it: ``workers`` (their closed loops), ``cpus`` or ``gateway``."""
    cycle_us: float


@dataclass(frozen=True)
class Model:
    env: Line
    gateway: Line
    overhead: Line

    @classmethod
    def fit(cls, points: list[Point]) -> Model:
        """Fit each cost over the calibration points (overhead from one-worker points)."""
        solo = [p for p in points if p.overhead_us is not None]
        if not solo:
            raise ValueError("calibration needs at least one run with a single worker")
        xs = [float(p.num_envs) for p in points]
        return cls(
            env=Line.fit(xs, [p.env_us for p in points], proportional=True),
            gateway=Line.fit(xs, [p.gateway_us for p in points], proportional=False),
            overhead=Line.fit(
                [float(p.num_envs) for p in solo],
                [float(p.overhead_us or 0.0) for p in solo],
                proportional=False,
            ),
        )

    def predict(self, *, workers: int, num_envs: int, cpus: int) -> Prediction:
        env, gw, ovh = self.env.at(num_envs), self.gateway.at(num_envs), self.overhead.at(num_envs)
        cycle = env + gw + ovh
        limits = {"workers": workers / cycle, "cpus": cpus / cycle}
        if gw > 0:
            limits["gateway"] = 1.0 / gw
        name = min(limits, key=lambda k: limits[k])
        return Prediction(1e6 * limits[name] * num_envs, name, cycle)
