"""The trainer: update rate with 1 and 2 processes, weight publication, policy lag.

- ``trainer.updates_per_s.np1|np2`` (and ``trainer.samples_per_s.*``,
  ``trainer.data_wait_frac.*``): SAC on the reach task in one process (plain modules:
  a group of one on the CPU is not sharded) or FSDP2 over 2 gloo processes
  (``torchrun``), every 256-transition batch sampled from a real replay service holding
  20 000 reach transitions; ``np2`` is compared with ``np1``.
- ``weights.sync_s.1M|10M|100M``: the trainer's publication of a policy of that many
  parameters: the full state dict of the actor as a one-process trainer holds it
  (``full_state_dict``, into the previous snapshot's buffers as the trainer does) and
  published to a real inference server (torch backend) until
  it acknowledges (transfer, validation, load, swap), against
  ``zmq.raw_send_s.<size>``: the same bytes in the same buckets over the same socket
  type (DEALER to ROUTER) to a receiver that only acknowledges. Target ratio <= 1.5.
  Steady state: the first ``WARMUP_PUBLICATIONS`` publications are not timed; then
  medians of at least ``SYNC_PUBLICATIONS`` publications per size.
- ``policy_lag.p99.async``: the 99th percentile of policy lag (versions) over every
  step recorded by ``loopgate up`` in async mode with the trainer, inference server and
  replay service under full collection load (the gateway measures it per step).

    loopgate bench --only trainer
    loopgate bench --only weights.sync
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from benchmarks.procs import REPO, Processes, split_placement, tied
from benchmarks.records import Record

log = logging.getLogger(__name__)

WEIGHT_SIZES: dict[str, tuple[int, ...]] = {
    "1M": (1024, 1024),
    "10M": (2304, 2304, 2304),
    "100M": (7000, 7000, 7000),
}
"""Actor hidden sizes giving about 1, 10 and 100 million parameters."""
WARMUP_PUBLICATIONS = 3
"""Untimed publications first: the trainer reuses a finished snapshot's buffers and the
server reassembles into buffers of versions retired two swaps later, so from the third
publication on no 100 MB-scale allocation (and its page faults) is left in the path:
the steady state of a trainer publishing every K updates."""
SYNC_PUBLICATIONS: dict[str, int] = {"1M": 30, "10M": 10}
"""Timed publications per size (at least ``--repeats``): a 1M publication takes 4-6 ms,
which moves by a millisecond or more between publications on a shared machine, so a median of
three (what ``--repeats 5`` gave) moved the ratio by 0.1-0.5 between runs."""
SETTLE_S = 0.02
"""Pause between a publication's answer and the raw send it is compared with. Once it has
answered, the server builds the next version's module structure on its core (1-2 ms of
Python at normal priority): a raw send meanwhile shared that core and was measured up to
twice as slow (4.5-4.8 ms against 2.3-2.4 ms settled), which flattered the ratio."""

NAMES: tuple[str, ...] = (
    *(f"trainer.{m}.np{n}" for m in ("updates_per_s", "samples_per_s", "data_wait_frac") for n in (1, 2)),
    *(f"{k}.{s}" for k in ("weights.sync_s", "zmq.raw_send_s") for s in WEIGHT_SIZES),
    "policy_lag.p99.async",
)


def reach_chunks(steps: int, episode: int = 50, chunk: int = 25) -> list[Any]:
    """Synthetic reach-task trajectory chunks (random but well-formed)."""
    from gateway.factory import experiment_spec
    from gateway.trajectory import StepRows

    spec = experiment_spec("mujoco_reach", {})
    rng = np.random.default_rng(0)
    chunks = []
    for e in range(steps // episode):
        rows = StepRows(f"bench-{e}", "bench", 0, "reach")
        for s in range(episode):
            rows.add(
                {k: rng.standard_normal(a.shape).astype(a.dtype) for k, a in spec.observation.items()},
                rng.uniform(-1, 1, 3).astype(np.float32),
                reward=-0.1,
                terminated=False,
                truncated=s == episode - 1,
                success=False,
                policy_version=0,
                t_capture=0.0,
                t_action=0.0,
                step=s,
            )
        for first in range(0, episode, chunk):
            part = rows.take(chunk)
            final = first + chunk == episode
            last = {k: v[-1] for k, v in part.obs.items()}
            chunks.append(
                part.to_chunk(end="truncated" if final else None, final_obs=last if final else None)
            )
    return chunks


DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def clean_env() -> dict[str, str]:
    """This process's environment without process-group variables, one thread per process."""
    return {**{k: v for k, v in os.environ.items() if k not in DIST_VARS}, "OMP_NUM_THREADS": "1"}


def update_rates(tmp: Path, updates: int, repeats: int) -> dict[str, list[float]]:
    from benchmarks.replay import ServiceRun, _feed
    from trainer.replay.client import ReplayClient
    from trainer.replay.sink import ReplaySink

    chunks = reach_chunks(20_000)
    figures: dict[str, list[float]] = {}
    replay = {"tables": [{"name": "online", "max_size": 30_000}], "fsync": "never"}
    with ServiceRun(tmp, f"trainer-replay-{time.monotonic_ns()}", set(split_placement()[0]), replay) as svc:
        sink = ReplaySink(svc.endpoints["ingest"])
        try:
            _feed(sink, chunks)
        finally:
            sink.close()
        with ReplayClient(svc.endpoints["sample"]) as client:
            deadline = time.monotonic() + 60
            while client.status()["tables"]["online"]["size"] < 19_000 and time.monotonic() < deadline:
                time.sleep(0.1)
        for _ in range(repeats):
            for n in (1, 2):
                out = tmp / f"np{n}-{time.monotonic_ns()}.json"
                launcher = (
                    [sys.executable, "-m", "benchmarks.trainer_worker"]
                    if n == 1
                    else [
                        sys.executable,
                        "-m",
                        "torch.distributed.run",
                        "--standalone",
                        f"--nproc_per_node={n}",
                        "-m",
                        "benchmarks.trainer_worker",
                    ]
                )
                run = subprocess.run(
                    [*launcher, svc.endpoints["sample"], str(updates), str(out)],
                    cwd=REPO,
                    capture_output=True,
                    text=True,
                    timeout=600,
                    **tied(clean_env()),
                )
                if run.returncode != 0:
                    raise RuntimeError(f"trainer worker np{n} failed: {run.stderr[-2000:]}")
                result = json.loads(out.read_text())
                for metric in ("updates_per_s", "samples_per_s", "data_wait_frac"):
                    figures.setdefault(f"trainer.{metric}.np{n}", []).append(result[metric])
    return figures


def weight_sync(tmp: Path, sizes: list[str], repeats: int) -> dict[str, list[float]]:
    from trainer.distributed import init_distributed, shutdown

    saved = {k: os.environ[k] for k in DIST_VARS if k in os.environ}
    world = init_distributed(timeout_s=300)  # a group of one, as a single-process trainer has
    try:
        return _publish_sizes(world, tmp, sizes, repeats)
    finally:
        shutdown()
        for k in DIST_VARS:
            os.environ.pop(k, None)
        os.environ.update(saved)


def _publish_sizes(world: Any, tmp: Path, sizes: list[str], repeats: int) -> dict[str, list[float]]:
    from benchmarks.inference import raw_send_ms, start_loopgate
    from gateway.factory import experiment_spec
    from inference.weights import DEFAULT_BUCKET_BYTES, WeightsPublisher
    from networks.config import NetworkConfig
    from networks.modules import make_actor
    from trainer.distributed import shard
    from trainer.publish import full_state_dict

    spec = experiment_spec("mujoco_reach", {})
    server_cpus, _ = split_placement()
    figures: dict[str, list[float]] = {}
    for label in sizes:
        hidden = WEIGHT_SIZES[label]
        actor = shard(make_actor(spec, NetworkConfig(hidden_sizes=hidden), seed=1), world, ("sample",))
        with Processes(tmp / "logs" / f"weights-{label}") as procs:
            addresses = start_loopgate(
                procs, tmp, f"weights-{label}-{time.monotonic_ns()}", "torch", None, hidden, server_cpus
            )
            publisher = WeightsPublisher([addresses], timeout_s=300.0)
            arrays = None
            try:
                timed = max(repeats, SYNC_PUBLICATIONS.get(label, 0))
                for version in range(1, WARMUP_PUBLICATIONS + timed + 1):
                    t0 = time.perf_counter()
                    # Into the last snapshot's buffers, as the trainer's publisher does
                    # once a publication has been answered.
                    arrays = full_state_dict(actor, arrays)
                    publisher.publish(arrays, version)
                    elapsed = time.perf_counter() - t0
                    if version <= WARMUP_PUBLICATIONS:
                        continue
                    figures.setdefault(f"weights.sync_s.{label}", []).append(elapsed)
                    time.sleep(SETTLE_S)
                    figures.setdefault(f"zmq.raw_send_s.{label}", []).append(
                        raw_send_ms(arrays, DEFAULT_BUCKET_BYTES) / 1e3
                    )
            finally:
                publisher.close()
        del actor
    return figures


def policy_lag(tmp: Path) -> float:
    """p99 policy lag of a short async run of the whole loop (``loopgate up``)."""
    run = tmp / f"lag-{time.monotonic_ns()}"
    cfg = yaml.safe_load((REPO / "configs" / "reach_sim.yaml").read_text())
    cfg["trainer"].update({"max_updates": 300, "eval_every": 0, "final_eval_episodes": 0, "mode": "async"})
    path = tmp / "lag.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "up", str(path), "--run-dir", str(run), "--log-level", "WARNING"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
        **tied(),
    )
    if out.returncode != 0:
        raise RuntimeError(f"loopgate up failed: {out.stderr[-2000:]}")
    return float(json.loads((run / "summary.json").read_text())["policy_lag_p99"])


def run(quick: bool, repeats: int) -> list[Record]:
    with tempfile.TemporaryDirectory(prefix="loopgate-bench-trainer-") as tmp_name:
        tmp = Path(tmp_name)
        reps = 1 if quick else max(2, min(repeats, 3))
        figures = update_rates(tmp, 30 if quick else 150, reps)
        figures.update(weight_sync(tmp, ["1M"] if quick else list(WEIGHT_SIZES), reps))
        lag = None if quick else policy_lag(tmp)
    note = "SAC 256x256, batch 256 from a replay service over TCP, FSDP2 on gloo"
    records = [
        Record.median_of(
            "trainer.updates_per_s.np1", figures["trainer.updates_per_s.np1"], "updates/s", note=note
        ),
        Record.median_of(
            "trainer.updates_per_s.np2",
            figures["trainer.updates_per_s.np2"],
            "updates/s",
            note=note,
            baseline="trainer.updates_per_s.np1",
        ),
    ]
    for n in (1, 2):
        records.append(
            Record.median_of(
                f"trainer.samples_per_s.np{n}", figures[f"trainer.samples_per_s.np{n}"], "samples/s"
            )
        )
        records.append(
            Record.median_of(
                f"trainer.data_wait_frac.np{n}",
                figures[f"trainer.data_wait_frac.np{n}"],
                "fraction",
                note="time waiting for batches / (waiting + computing)",
            )
        )
    for label in WEIGHT_SIZES:
        if f"weights.sync_s.{label}" not in figures:
            continue
        records.append(
            Record.median_of(
                f"zmq.raw_send_s.{label}",
                figures[f"zmq.raw_send_s.{label}"],
                "s",
                note="same bytes, same buckets, DEALER->ROUTER, acknowledged",
            )
        )
        records.append(
            Record.median_of(
                f"weights.sync_s.{label}",
                figures[f"weights.sync_s.{label}"],
                "s",
                baseline=f"zmq.raw_send_s.{label}",
                target="<= 1.5",
                note="FSDP full state dict + publish to a torch inference server, acked",
            )
        )
    if lag is not None:
        records.append(
            Record(
                name="policy_lag.p99.async",
                value=lag,
                unit="versions",
                note="loopgate up, configs/reach_sim.yaml, 300 updates, async",
            )
        )
    return records
