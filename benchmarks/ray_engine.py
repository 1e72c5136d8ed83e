"""What the Ray engine costs: collection throughput, start-up and recovery against the local engine.

On a three-node ``ray.cluster_utils.Cluster`` on this machine (:mod:`benchmarks.ray_cluster`),
with the same processes ``loopgate up`` starts (:class:`benchmarks.collect.CollectRun`: a
gateway running ``reach_pd`` in-process, MuJoCo reach workers of 4 envs each):

- ``ray.collect.steps_per_s.wK`` (K = 1, 2, 4 workers): the services as Ray actors, each
  its own process on the node Ray chose; baseline ``collect.steps_per_s.wK``: the same
  services as child processes (the local engine), up at the same time and measured in
  turn, alternating from repeat to repeat, the other paused. Target: ratio >= 0.95 (Ray
  only places and watches; ZeroMQ carries every step either way).
- ``ray.start_s``: from asking the cluster for the services (engine connected) to every
  worker stepping; baseline ``local.start_s``, the same from the local engine's first
  ``Popen``. ``ray.cluster_start_s``: bringing the three nodes up (no baseline; ``loopgate
  up`` joins a running cluster).
- ``ray.recover_s``: one worker on the GPU node collecting; a spare node joins, the GPU
  node is removed: time until the worker, restarted on the spare node, has stepped again
  (Ray's node-death detection, the supervisor's backoff, the worker's start, its HELLO).

Everything runs on the same CPUs (the machine's), so ratios compare like with like::

    loopgate bench --only ray.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks.collect import CollectRun, _windows
from benchmarks.procs import available_cpus, describe_cpus
from benchmarks.records import Record

log = logging.getLogger(__name__)

WORKERS = (1, 2, 4)
ENVS_PER_WORKER = 4
TARGET = ">= 0.95"
NAMES: tuple[str, ...] = (
    *(f"ray.collect.steps_per_s.w{k}" for k in WORKERS),
    *(f"collect.steps_per_s.w{k}" for k in WORKERS),
    "ray.start_s",
    "local.start_s",
    "ray.cluster_start_s",
    "ray.recover_s",
)
RECOVER_TIMEOUT_S = 120.0


class RayCollectRun(CollectRun):
    """:class:`CollectRun` with every service placed on the Ray cluster by the Ray engine."""

    def __init__(
        self, num_envs: int, run_dir: Path, *, workers: int, address: str, placement: Any = None
    ) -> None:
        from gateway.config import from_dict
        from gateway.engines.ray_engine import RayEngine

        super().__init__(num_envs, run_dir, workers=workers)
        cfg = from_dict({"run": {"engine": "ray", "ray_address": address, "placement": placement or {}}})
        self.engine = RayEngine(cfg)
        sup = self.supervisor
        sup.launcher = self.engine.launcher(cfg, sup.run)
        self.note += ", each service a Ray actor's child process"

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.engine.close()

    def steps(self) -> int:
        self._check()
        return int(self.request("status")["env_steps"])


def timed_start(run: CollectRun) -> float:
    t0 = time.perf_counter()
    run.start()
    return time.perf_counter() - t0


def recover_once(cluster: Any, tmp: Path, index: int) -> float:
    """Seconds from removing the node under a collecting worker to its next steps."""
    from benchmarks.ray_cluster import GPU_NODE

    placement = {"worker": {"resources": {"gpu_node": 1}}}
    run = RayCollectRun(
        ENVS_PER_WORKER, tmp / f"recover-{index}", workers=1, address=cluster.address, placement=placement
    )
    try:
        run.start()
        run.request("resume")
        time.sleep(1.0)
        spare = cluster.add(GPU_NODE)
        lost, cluster.gpu = cluster.gpu, spare
        before = run.steps()
        t0 = time.perf_counter()
        cluster.remove(lost)
        deadline = time.monotonic() + RECOVER_TIMEOUT_S
        # Steps the worker sent just before its node went may still be counted: wait for
        # the restarted worker's own (ten observations of its envs), and for its restart.
        while True:
            steps = run.steps()  # also supervises: restarts the lost worker
            if run.supervisor.procs["worker-0"].restarts >= 1 and steps >= before + 10 * ENVS_PER_WORKER:
                return time.perf_counter() - t0
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"collection did not resume within {RECOVER_TIMEOUT_S:.0f} s of the node loss"
                )
            time.sleep(0.02)
    finally:
        run.close()


def run(quick: bool, repeats: int) -> list[Record]:
    from benchmarks.ray_cluster import ThreeNodes

    warmup_s, window_s = _windows(quick)
    placement = f"all on cpus {describe_cpus(set(available_cpus()))}"
    timing = f"median of {repeats} x {window_s:g} s after {warmup_s:g} s warm-up, {placement}"
    records: list[Record] = []
    starts: dict[str, list[float]] = {"local": [], "ray": []}
    t0 = time.perf_counter()
    cluster = ThreeNodes()
    cluster_start = time.perf_counter() - t0
    try:
        with tempfile.TemporaryDirectory(prefix="loopgate-bench-ray-") as tmp:
            for k in WORKERS:
                values: dict[str, list[float]] = {"local": [], "ray": []}
                with ExitStack() as stack:
                    local = CollectRun(k * ENVS_PER_WORKER, Path(tmp) / f"local-w{k}", workers=k)
                    stack.callback(local.close)
                    starts["local"].append(timed_start(local))
                    on_ray = RayCollectRun(
                        k * ENVS_PER_WORKER, Path(tmp) / f"ray-w{k}", workers=k, address=cluster.address
                    )
                    stack.callback(on_ray.close)
                    starts["ray"].append(timed_start(on_ray))
                    runners: dict[str, CollectRun] = {"local": local, "ray": on_ray}
                    kinds = list(runners)
                    for rep in range(repeats):
                        shift = rep % 2
                        for kind in kinds[shift:] + kinds[:shift]:
                            values[kind].append(runners[kind].measure(warmup_s, window_s))
                            log.info("%s w%d repeat %d: %.0f steps/s", kind, k, rep + 1, values[kind][-1])
                    note = local.note
                base = f"collect.steps_per_s.w{k}"
                records += [
                    Record.median_of(
                        base, values["local"], "steps/s", note=f"local engine; {note}; {timing}"
                    ),
                    Record.median_of(
                        f"ray.collect.steps_per_s.w{k}",
                        values["ray"],
                        "steps/s",
                        baseline=base,
                        note=f"{on_ray.note}; 3-node cluster on this machine; {timing}",
                        target=TARGET,
                    ),
                ]
            recover = [recover_once(cluster, Path(tmp), i) for i in range(max(1, min(repeats, 3)))]
    finally:
        cluster.shutdown()
    start_note = f"median over the {len(WORKERS)} runs above ({', '.join(f'w{k}' for k in WORKERS)})"
    records += [
        Record.median_of(
            "local.start_s", starts["local"], "s", note=f"first Popen to every worker stepping; {start_note}"
        ),
        Record.median_of(
            "ray.start_s",
            starts["ray"],
            "s",
            baseline="local.start_s",
            note=f"first actor requested to every worker stepping, cluster already up; {start_note}",
        ),
        Record.median_of(
            "ray.cluster_start_s",
            [cluster_start],
            "s",
            note="ray.cluster_utils.Cluster: head + 2 nodes, dashboard off, 80 MiB object stores",
        ),
        Record.median_of(
            "ray.recover_s",
            recover,
            "s",
            note=f"node under the only worker removed -> its restart on a spare node stepping; "
            f"median of {len(recover)}, node death declared after ~2 s (health checks)",
        ),
    ]
    log.info("ray suite: cluster up in %.1f s, recover %s", cluster_start, statistics.median(recover))
    return records
