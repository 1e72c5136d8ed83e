"""Observation -> action latency through ROS 2 and the gateway, against raw rclpy.

At 100 Hz and 500 Hz, and for each repeat, two measurements run back to back in
alternating order, with the same stand-in robot (:mod:`benchmarks.ros2_peers`
``robot``: joint states from a timer, round trip = state published -> first command
received, on its own clock):

- **rclpy** (baseline): an ``echo`` node answers each joint state with a command at
  once: the raw rclpy round trip between two processes on this machine;
- **ros2**: the product's path, as ``loopgate up`` runs it: an env worker
  (``python -m gateway.worker``) hosting the ``ros2`` backend, robot-clocked
  (``clock: robot``, each step waits for the joint state due next) at the robot's rate,
  and a gateway process with the in-process ``zero`` policy. The round trip covers
  the backend reading and aligning the state, the worker's OBSERVATION, the gateway's
  validation, spool write and policy, the ACTION back, the safety clamps and the
  command's publication.

Every process is placed by the OS, in both measurements: the product's path has more
processes and threads than the baseline's (executor thread, worker, gateway), and
pinning them onto one of two cores serialises their wake-ups, which on a busy machine
costs milliseconds that say nothing about either path. ``ros2.jitter_p*_us.500hz``
comes from a third run: the robot publishes steadily at 500 Hz and the backend's
control loop ticks on its own clock (``clock: backend``) at 500 Hz through the gateway;
jitter is how far each tick's period was from 2 ms, from the backend's own statistics
(``stats_file``). The target: the gateway adds at most 0.3 ms to the raw rclpy p50 (as a ratio: ``<= 1 + 300 us / rclpy p50``)::

    loopgate bench --only ros2
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.procs import Processes
from benchmarks.records import Record

log = logging.getLogger(__name__)

RATES = {"100hz": 100.0, "500hz": 500.0}
ADDED_US = 300.0
"""The team's goal: the gateway adds at most this much to raw rclpy's p50 round trip."""
NAMES: tuple[str, ...] = (
    *(f"{side}.rtt_p50_us.{label}" for label in RATES for side in ("rclpy", "ros2")),
    *(f"ros2.rtt_p99_us.{label}" for label in RATES),
    *(f"rclpy.rtt_p99_us.{label}" for label in RATES),
    "ros2.jitter_p50_us.500hz",
    "ros2.jitter_p99_us.500hz",
)
WAIT_S = 120.0


def _steps(quick: bool, rate: float) -> tuple[int, int]:
    seconds = 3.0 if quick else 10.0
    steps = int(rate * seconds)
    return max(50, steps // 10), steps


def _robot(procs: Processes, tmp: Path, rate: float, warmup: int, steps: int, *extra: str) -> None:
    args = ["robot", "--rate", str(rate), "--steps", str(steps), "--warmup", str(warmup)]
    procs.python(
        "robot",
        "benchmarks.ros2_peers",
        *args,
        "--out",
        str(tmp / "rtt.npz"),
        "--timeout-s",
        str(WAIT_S),
        *extra,
    )


def measure_rclpy(tmp: Path, rate: float, warmup: int, steps: int) -> dict[str, float]:
    with Processes(tmp / "logs") as procs:
        procs.python("echo", "benchmarks.ros2_peers", "echo")
        _robot(procs, tmp, rate, warmup, steps)
        procs.wait("robot", WAIT_S + 30)
        procs.check_alive("echo")
    rtt = np.load(tmp / "rtt.npz")["rtt_us"]
    return {"p50": float(np.percentile(rtt, 50)), "p99": float(np.percentile(rtt, 99))}


def write_run(run_dir: Path, rate: float, clock: str) -> Path:
    """A run folder for a gateway and one ros2 worker (as ``loopgate up`` prepares it)."""
    from gateway.services import free_port

    run_dir.mkdir(parents=True, exist_ok=True)
    options = {
        "control_hz": rate,
        "clock": clock,
        "namespaces": ["/bench"],
        "max_episode_steps": 1_000_000,
        "max_age_s": 0.05,
        "reset": {"move_home": False},
        "safety": {"max_velocity": 1000.0, "max_step_change": 10.0, "watchdog_timeout_s": 1.0},
        "stats_file": str(run_dir / "loop_stats.json"),
    }
    config = {
        "env": {"backend": "ros2", "num_envs": 1, "options": options},
        "policy": {"kind": "zero"},
        "gateway": {"host": "127.0.0.1", "transport": "tcp"},
    }
    (run_dir / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
    endpoints = {
        "gateway": {name: f"tcp://127.0.0.1:{free_port()}" for name in ("workers", "clients", "control")}
    }
    (run_dir / "endpoints.json").write_text(json.dumps(endpoints))
    return run_dir / "config.yaml"


def measure_ros2(
    tmp: Path, rate: float, warmup: int, steps: int, *, clock: str = "robot"
) -> dict[str, float]:
    """The product's path; ``clock: backend`` with a steadily publishing robot measures the loop's jitter."""
    run_dir = tmp / "run"
    config = write_run(run_dir, rate, clock)
    common = ["--config", str(config), "--log-level", "WARNING"]
    with Processes(tmp / "logs") as procs:
        procs.python("gateway", "gateway.hub", *common, "--run-dir", str(run_dir))
        procs.python("worker", "gateway.worker", *common, "--endpoints", str(run_dir / "endpoints.json"))
        _robot(procs, tmp, rate, warmup, steps, *(["--free-run"] if clock == "backend" else []))
        procs.wait("robot", WAIT_S + 30)
        procs.check_alive("gateway", "worker")
        procs.stop("worker")  # SIGTERM: the backend closes and writes its loop statistics
    rtt = np.load(tmp / "rtt.npz")["rtt_us"]
    stats = json.loads((run_dir / "loop_stats.json").read_text())
    return {
        "p50": float(np.percentile(rtt, 50)),
        "p99": float(np.percentile(rtt, 99)),
        "jitter_p50": float(stats["jitter_p50_us"]),
        "jitter_p99": float(stats["jitter_p99_us"]),
    }


def run(quick: bool, repeats: int) -> list[Record]:
    """Both paths at both rates and the 500 Hz loop, ``repeats`` times each, interleaved."""
    from robots.testing import DomainLease, ros2_available, ros_env

    why_not = ros2_available()
    if why_not:
        log.warning("skipping the ROS 2 benchmarks: %s", why_not)
        return []
    records: list[Record] = []
    with DomainLease() as domain:
        saved = {k: os.environ.get(k) for k in ros_env(domain.id)}
        os.environ.update(ros_env(domain.id))  # children join this run's own ROS domain
        try:
            for label, rate in RATES.items():
                warmup, steps = _steps(quick, rate)
                per: dict[str, list[dict[str, float]]] = {"rclpy": [], "ros2": [], "loop": []}
                for rep in range(repeats):
                    sides = ["rclpy", "ros2"] if rep % 2 == 0 else ["ros2", "rclpy"]
                    for side in [*sides, *(["loop"] if label == "500hz" else [])]:
                        with tempfile.TemporaryDirectory(prefix=f"loopgate-bench-{side}-") as tmp:
                            if side == "rclpy":
                                result = measure_rclpy(Path(tmp), rate, warmup, steps)
                            else:
                                clock = "backend" if side == "loop" else "robot"
                                result = measure_ros2(Path(tmp), rate, warmup, steps, clock=clock)
                        per[side].append(result)
                        log.info("%s %s repeat %d: %s", side, label, rep + 1, per[side][-1])
                records += _records(label, per, f"{steps} round trips after {warmup}, placed by the OS")
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    return records


def _records(label: str, per: dict[str, list[dict[str, float]]], note: str) -> list[Record]:
    base = Record.median_of(f"rclpy.rtt_p50_us.{label}", [m["p50"] for m in per["rclpy"]], "us", note=note)
    added = f"the gateway adds <= {ADDED_US:.0f} us to rclpy's p50"
    out = [
        base,
        Record.median_of(
            f"ros2.rtt_p50_us.{label}",
            [m["p50"] for m in per["ros2"]],
            "us",
            baseline=base.name,
            note=f"{note}; target: {added}",
            target=f"<= {1 + ADDED_US / base.value:.3f}",
        ),
        Record.median_of(f"rclpy.rtt_p99_us.{label}", [m["p99"] for m in per["rclpy"]], "us", note=note),
        Record.median_of(
            f"ros2.rtt_p99_us.{label}",
            [m["p99"] for m in per["ros2"]],
            "us",
            baseline=f"rclpy.rtt_p99_us.{label}",
            note=note,
        ),
    ]
    if per["loop"]:
        loop = "|tick period - 2 ms| of the backend-clocked 500 Hz loop through the gateway, steady robot"
        for q in ("p50", "p99"):
            values = [m[f"jitter_{q}"] for m in per["loop"]]
            out.append(Record.median_of(f"ros2.jitter_{q}_us.500hz", values, "us", note=loop))
    return out


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    for record in run(quick="--quick" in sys.argv, repeats=1):
        print(record.name, round(record.value, 1), record.unit)
