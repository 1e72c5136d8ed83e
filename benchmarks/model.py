"""Checks the performance model (:mod:`gateway.perf_model`) against measured runs.

The model is calibrated on two one-worker shapes (1 x 1 and 1 x 8 envs: the per-message
costs and their growth with the env count), then predicts the steps/s of shapes it
has not seen, each of which is then run and measured the same way, all in this run:

- ``model.measured_steps_per_s.wWeE``: the gateway's own count of recorded steps per
  second over a window after warm-up, ``W`` workers x ``E`` envs of ``mujoco_reach``
  with the ``reach_pd`` policy in the gateway (the processes ``loopgate up`` starts,
  as :mod:`benchmarks.collect` builds them);
- ``model.predicted_steps_per_s.wWeE``: the model's figure, with the measured one as its
  baseline; the target is a ratio within 0.8 .. 1.2 (within 20 %). Its note names the
  limit the model took (the workers' loops, the CPUs or the gateway).

Medians over repeats; each repeat re-measures every shape (calibration included) in
turn, so the costs and the checks come from the same minutes of the same machine::

    loopgate bench --only model
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

from benchmarks.procs import available_cpus, describe_cpus
from benchmarks.records import Record
from gateway.perf_model import Model, Point, point_from_run

log = logging.getLogger(__name__)

CALIBRATION = ((1, 1), (1, 8))
"""(workers, envs per worker) the model learns its costs from."""
CHECKS = ((1, 4), (2, 2), (2, 8), (4, 4))
"""Shapes it predicts and the benchmark then measures."""
TARGET = "0.8 .. 1.2"

NAMES: tuple[str, ...] = tuple(
    f"model.{kind}_steps_per_s.w{w}e{e}" for w, e in CHECKS for kind in ("measured", "predicted")
)


def _windows(quick: bool) -> tuple[float, float]:
    """(warm-up, measured) seconds; the gateway writes a metrics record every second."""
    return (1.0, 3.0) if quick else (2.0, 5.0)


def measure(workers: int, per_worker: int, warmup_s: float, window_s: float, tmp: Path) -> Point:
    """One shape's :class:`~gateway.perf_model.Point`, from its own run folder."""
    from benchmarks.collect import CollectRun

    run_dir = tmp / f"w{workers}e{per_worker}-{time.monotonic_ns()}"
    run = CollectRun(workers * per_worker, run_dir, workers=workers)
    try:
        run.start()
        run.request("resume")
        since = time.time() + warmup_s
        time.sleep(warmup_s + window_s + 0.1)
        until = time.time()
        run.request("pause")
    finally:
        run.close()
    point = point_from_run(run_dir, since=since, until=until)
    log.info(
        "w%d x e%d: %.0f steps/s (env %.0f µs, gateway %.0f µs per message, overhead %s)",
        workers,
        per_worker,
        point.steps_per_s,
        point.env_us,
        point.gateway_us,
        "n/a" if point.overhead_us is None else f"{point.overhead_us:.0f} µs",
    )
    return point


def run(quick: bool, repeats: int) -> list[Record]:
    cpus = len(available_cpus())
    warmup_s, window_s = _windows(quick)
    measured: dict[tuple[int, int], list[float]] = {shape: [] for shape in CHECKS}
    predicted: dict[tuple[int, int], list[float]] = {shape: [] for shape in CHECKS}
    limits: dict[tuple[int, int], str] = {}
    with tempfile.TemporaryDirectory(prefix="loopgate-bench-model-") as tmp:
        for rep in range(repeats):
            model = Model.fit([measure(w, e, warmup_s, window_s, Path(tmp)) for w, e in CALIBRATION])
            for w, e in CHECKS:
                guess = model.predict(workers=w, num_envs=e, cpus=cpus)
                point = measure(w, e, warmup_s, window_s, Path(tmp))
                predicted[(w, e)].append(guess.steps_per_s)
                measured[(w, e)].append(point.steps_per_s)
                limits[(w, e)] = guess.limit
                log.info(
                    "repeat %d, w%d x e%d: predicted %.0f (%s), measured %.0f steps/s",
                    rep + 1,
                    w,
                    e,
                    guess.steps_per_s,
                    guess.limit,
                    point.steps_per_s,
                )
    timing = (
        f"median of {repeats}; {window_s:g} s windows after {warmup_s:g} s warm-up; "
        f"all on cpus {describe_cpus(set(available_cpus()))}"
    )
    calib = ", ".join(f"{w}x{e}" for w, e in CALIBRATION)
    records: list[Record] = []
    for w, e in CHECKS:
        m_name = f"model.measured_steps_per_s.w{w}e{e}"
        records += [
            Record.median_of(
                m_name, measured[(w, e)], "steps/s", note=f"{w} worker(s) x {e} env(s) mujoco_reach; {timing}"
            ),
            Record.median_of(
                f"model.predicted_steps_per_s.w{w}e{e}",
                predicted[(w, e)],
                "steps/s",
                baseline=m_name,
                target=TARGET,
                note=f"calibrated on {calib}; limited by {limits[(w, e)]} on {cpus} CPU(s)",
            ),
        ]
    return records
