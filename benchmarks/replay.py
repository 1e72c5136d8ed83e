"""Replay: insert, sample(256) and durable ingest, against TorchRL's ReplayBuffer in the same run.

Two observation layouts, ``f32x32`` (``obs`` f32[32]) and ``u8x84x84x3`` (an 84x84 RGB
camera), transitions with their next observation, action f32[4], reward and flags:

- ``replay.insert_per_s.inproc.<layout>``: transitions/s into a
  :class:`~trainer.replay.core.ReplayBuffer` (64-step trajectory chunks, items built
  from them) against ``torchrl.insert_per_s.<layout>`` (``ReplayBuffer`` with
  ``LazyTensorStorage``, ``extend`` with TensorDicts of the same 64 transitions, next
  observations stored beside them as TorchRL does);
- ``replay.sample_per_s.inproc[_prio].<layout>``: transitions/s of ``sample(256)`` in
  process (uniform; prioritized with a sum tree) against ``torchrl.sample_per_s[.prio]``
  (TorchRL's ``PrioritizedSampler`` needs its compiled extension, which does not load
  with torch 2.13.0: that baseline is reported missing when it fails);
- ``replay.sample_per_s.socket[_prio].<layout>``: the same from the replay service
  process over TCP loopback with :class:`~trainer.replay.client.ReplayClient` (4
  requests in flight), target at least half of TorchRL in process;
- ``replay.ingest_steps_per_s.fsync``: steps/s from the gateway's sink into the
  service until acknowledged, with ``fsync: always`` (one fsync per group commit),
  against ``segment_log.steps_per_s.fsync``: the same chunks appended to a bare
  :class:`~gateway.segment_log.SegmentLog` in process, fsync every 16 chunks.

The service runs on the first allowed CPU, in this process's session (see
:class:`ServiceRun`), this process (client, in-process buffers, TorchRL) on the second;
figures are medians over repeats::

    loopgate bench --only replay
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.procs import REPO, pinned, split_placement, tied
from benchmarks.records import Record

log = logging.getLogger(__name__)

LAYOUTS: dict[str, tuple[tuple[int, ...], str]] = {
    "f32x32": ((32,), "float32"),
    "u8x84x84x3": ((84, 84, 3), "uint8"),
}
BATCH = 256
CHUNK = 64
EPISODE = 256

NAMES: tuple[str, ...] = (
    *(f"replay.insert_per_s.inproc.{x}" for x in LAYOUTS),
    *(
        f"replay.sample_per_s.{w}.{x}"
        for x in LAYOUTS
        for w in ("inproc", "inproc_prio", "socket", "socket_prio")
    ),
    *(f"torchrl.sample_per_s.{x}" for x in LAYOUTS),
    *(f"torchrl.sample_per_s.prio.{x}" for x in LAYOUTS),
    *(f"torchrl.insert_per_s.{x}" for x in LAYOUTS),
    "replay.ingest_steps_per_s.fsync",
    "segment_log.steps_per_s.fsync",
)


def _sizes(quick: bool, layout: str) -> tuple[int, int]:
    """(transitions stored, sample calls timed)."""
    if layout == "f32x32":
        return (8192, 400) if quick else (32768, 2000)
    return (2048, 40) if quick else (4096, 150)


def make_chunks(layout: str, steps: int) -> list[Any]:
    """Trajectory chunks of ``steps`` transitions in episodes of ``EPISODE`` steps."""
    from gateway.protocol import Message, MsgType

    shape, dtype = LAYOUTS[layout]
    rng = np.random.default_rng(0)
    chunks = []
    for e in range(steps // EPISODE):
        episode = f"bench-{e}"
        for first in range(0, EPISODE, CHUNK):
            final = first + CHUNK == EPISODE
            obs = (rng.random((CHUNK, *shape)) * (255 if dtype == "uint8" else 1)).astype(dtype)
            arrays = {
                "obs/x": obs,
                "action": rng.random((CHUNK, 4), dtype=np.float32),
                "reward": rng.random(CHUNK, dtype=np.float32),
                "terminated": np.zeros(CHUNK, bool),
                "truncated": np.arange(CHUNK) == CHUNK - 1 if final else np.zeros(CHUNK, bool),
                "success": np.zeros(CHUNK, bool),
                "policy_version": np.zeros(CHUNK, np.int64),
                "t_capture": np.zeros(CHUNK),
                "t_action": np.zeros(CHUNK),
                "step": np.arange(first, first + CHUNK, dtype=np.int64),
            }
            if final:
                arrays["final_obs/x"] = obs[-1:].copy()
            meta = {
                "chunk_id": f"{episode}:{first}",
                "episode_id": episode,
                "worker": "bench",
                "env": 0,
                "task": "bench",
                "first_step": first,
                "num_steps": CHUNK,
                "final": final,
                "end": "truncated" if final else None,
                "eval": False,
            }
            chunks.append(Message(MsgType.TRAJECTORY_CHUNK, meta=meta, arrays=arrays))
    return chunks


def replay_config(steps: int, sampler: str, **extra: Any) -> Any:
    from trainer.replay.config import ReplayConfig, TableConfig

    table = TableConfig(name="online", sampler=sampler, max_size=steps)  # type: ignore[arg-type]
    return ReplayConfig(tables=[table], storage_steps=steps + EPISODE, **extra)


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.02)


def _rate(n: int, fn: Callable[[], Any], calls: int) -> float:
    for _ in range(max(5, calls // 10)):  # warm-up (caches, the request pipeline)
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return n * calls / (time.perf_counter() - start)


# ----------------------------------------------------------------- in process


def inproc(layout: str, chunks: list[Any], calls: int, sampler: str) -> tuple[float, float]:
    """(insert transitions/s, sample transitions/s) of a ReplayBuffer."""
    from trainer.replay.core import ReplayBuffer

    steps = len(chunks) * CHUNK
    buf = ReplayBuffer(replay_config(steps, sampler))
    start = time.perf_counter()
    for chunk in chunks:
        buf.insert(chunk)
    insert = buf.tables["online"].size / (time.perf_counter() - start)
    if sampler == "prioritized":
        batch = buf.sample({"online": BATCH})
        buf.update_priorities(batch["key"], np.random.default_rng(1).random(BATCH) + 0.1)
    return insert, _rate(BATCH, lambda: buf.sample({"online": BATCH}), calls)


def torchrl_rates(
    layout: str, chunks: list[Any], calls: int, prioritized: bool
) -> tuple[float, float] | None:
    """(insert, sample) transitions/s of TorchRL's ReplayBuffer; None if it cannot run."""
    import torch
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, PrioritizedSampler, ReplayBuffer

    steps = len(chunks) * CHUNK
    try:
        sampler = PrioritizedSampler(steps, alpha=0.6, beta=0.4) if prioritized else None
    except RuntimeError as exc:  # its compiled sum tree does not load with torch 2.13.0
        log.warning("torchrl prioritized sampler unavailable: %s", exc)
        return None
    rb = ReplayBuffer(storage=LazyTensorStorage(steps), sampler=sampler, batch_size=BATCH)
    tds = []
    for c in chunks:
        obs = torch.from_numpy(np.ascontiguousarray(c.arrays["obs/x"]))
        nxt = torch.cat([obs[1:], torch.from_numpy(c.arrays.get("final_obs/x", c.arrays["obs/x"][-1:]))])
        tds.append(
            TensorDict(
                {
                    "obs": obs,
                    "action": torch.from_numpy(c.arrays["action"]),
                    "next": {
                        "obs": nxt,
                        "reward": torch.from_numpy(c.arrays["reward"]),
                        "terminated": torch.from_numpy(c.arrays["terminated"]),
                        "truncated": torch.from_numpy(c.arrays["truncated"]),
                    },
                },
                batch_size=[CHUNK],
            )
        )
    try:
        start = time.perf_counter()
        for td in tds:
            rb.extend(td)
        insert = steps / (time.perf_counter() - start)
        sample = _rate(BATCH, rb.sample, calls)
    except RuntimeError as exc:
        log.warning("torchrl %s sampler failed: %s", "prioritized" if prioritized else "uniform", exc)
        return None
    return insert, sample


# --------------------------------------------------------------- over sockets


def _feed(sink: Any, chunks: list[Any], window: int = 64) -> float:
    """Send ``chunks`` through ``sink`` (``window`` unacknowledged at most); return seconds."""
    want = {c.meta["chunk_id"] for c in chunks}
    acked: set[str] = set()
    pending = list(chunks)
    start = time.perf_counter()
    deadline = time.monotonic() + 300
    while want - acked:
        while pending and sink.backlog() < window:
            sink.submit(pending.pop(0))
        if sink.sock.poll(5):
            acked.update(sink.poll_acks())
        sink.tick()
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(acked)} of {len(want)} chunks acknowledged")
    return time.perf_counter() - start


class ServiceRun:
    """A replay service process with a config of our choosing, stopped on leaving ``with``.

    Started in this process's session, unlike :class:`benchmarks.procs.Processes`: with
    the kernel's autogroup scheduling (on by default), a process in a session of its own
    is scheduled as a separate group, and on a machine shared with other load its every
    wake-up waited behind that load (sampling over the socket measured up to 8x slower).
    Same session, same footing as the TorchRL baseline running in this process.
    """

    def __init__(self, tmp: Path, name: str, cpus: set[int], replay: dict[str, Any]) -> None:
        import yaml

        self.name = name
        run_dir = tmp / name
        run_dir.mkdir(parents=True)
        config = run_dir / "config.yaml"
        config.write_text(
            yaml.safe_dump({"env": {"backend": "mujoco_reach"}, "replay": {"enabled": True, **replay}})
        )
        self.log_path = tmp / f"{name}.log"
        argv = [sys.executable, "-m", "trainer.replay", "--config", str(config), "--run-dir", str(run_dir)]
        with open(self.log_path, "wb") as out, pinned(cpus):
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, **tied())
        path = run_dir / "endpoints.json"

        def up() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited: {self.log_path.read_text(errors='replace')[-2000:]}")
            return path.exists() and "replay" in json.loads(path.read_text())

        try:
            wait_until(up, 60, f"{name} endpoints")
        except BaseException:
            self.stop()
            raise
        self.endpoints = json.loads(path.read_text())["replay"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> ServiceRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def socket_rates(
    tmp: Path,
    layout: str,
    chunks: list[Any],
    calls: int,
    sampler: str,
    cpus: tuple[set[int], set[int]],
) -> float:
    from trainer.replay.client import ReplayClient
    from trainer.replay.sink import ReplaySink

    steps = len(chunks) * CHUNK
    name = f"svc-{layout}-{sampler}-{time.monotonic_ns()}"
    table = {"name": "online", "sampler": sampler, "max_size": steps}
    replay = {"tables": [table], "storage_steps": steps + EPISODE, "fsync": "never"}
    with ServiceRun(tmp, name, cpus[0], replay) as svc:
        sink = ReplaySink(svc.endpoints["ingest"])
        try:
            _feed(sink, chunks)
        finally:
            sink.close()
        with ReplayClient(svc.endpoints["sample"], prefetch=4) as client:
            wait_until(
                lambda: client.status()["tables"]["online"]["size"] >= steps - len(chunks), 60, "table filled"
            )
            return _rate(BATCH, lambda: client.sample(BATCH, tables="online", timeout_s=30), calls)


def ingest_rates(tmp: Path, chunks: list[Any], cpus: tuple[set[int], set[int]]) -> tuple[float, float]:
    """(service steps/s acknowledged with fsync always, bare SegmentLog steps/s with fsync)."""
    from gateway.segment_log import SegmentLog
    from trainer.replay.sink import ReplaySink

    steps = len(chunks) * CHUNK
    name = f"ingest-{time.monotonic_ns()}"
    table = {"name": "online", "max_size": steps}
    replay = {"tables": [table], "storage_steps": steps + EPISODE, "fsync": "always"}
    with ServiceRun(tmp, name, cpus[0], replay) as svc:
        sink = ReplaySink(svc.endpoints["ingest"])
        try:
            service = steps / _feed(sink, chunks)
        finally:
            sink.close()
    seg = SegmentLog(tmp / f"bare-{name}", fsync="always")
    start = time.perf_counter()
    for i, chunk in enumerate(chunks):
        seg.append(chunk)
        if i % 16 == 15:
            seg.commit(force=True)
    seg.commit(force=True)
    bare = steps / (time.perf_counter() - start)
    seg.close()
    return service, bare


# ------------------------------------------------------------------------ run


def run(quick: bool, repeats: int) -> list[Record]:
    server, client = split_placement()
    values: dict[str, list[float]] = {}

    def add(name: str, value: float | None) -> None:
        if value is not None:
            values.setdefault(name, []).append(value)

    with tempfile.TemporaryDirectory(prefix="bench-replay-") as tmp_name:
        tmp = Path(tmp_name)
        for layout in LAYOUTS:
            steps, calls = _sizes(quick, layout)
            chunks = make_chunks(layout, steps)
            for _ in range(repeats):
                with pinned(client):
                    ins, smp = inproc(layout, chunks, calls, "uniform")
                    add(f"replay.insert_per_s.inproc.{layout}", ins)
                    add(f"replay.sample_per_s.inproc.{layout}", smp)
                    add(
                        f"replay.sample_per_s.inproc_prio.{layout}",
                        inproc(layout, chunks, calls, "prioritized")[1],
                    )
                    uni = torchrl_rates(layout, chunks, calls, prioritized=False)
                    if uni is not None:
                        add(f"torchrl.insert_per_s.{layout}", uni[0])
                        add(f"torchrl.sample_per_s.{layout}", uni[1])
                    prio = torchrl_rates(layout, chunks, calls, prioritized=True)
                    add(f"torchrl.sample_per_s.prio.{layout}", prio[1] if prio else None)
                    add(
                        f"replay.sample_per_s.socket.{layout}",
                        socket_rates(tmp, layout, chunks, calls, "uniform", (server, client)),
                    )
                    add(
                        f"replay.sample_per_s.socket_prio.{layout}",
                        socket_rates(tmp, layout, chunks, calls, "prioritized", (server, client)),
                    )
        ingest_chunks = make_chunks("f32x32", 4096 if quick else 16384)
        for _ in range(repeats):
            with pinned(client):
                service, bare = ingest_rates(tmp, ingest_chunks, (server, client))
            add("replay.ingest_steps_per_s.fsync", service)
            add("segment_log.steps_per_s.fsync", bare)
    return _records(values)


def _records(values: dict[str, list[float]]) -> list[Record]:
    records = []
    unit = "transitions/s"
    for name, vals in values.items():
        layout = name.rpartition(".")[2]
        baseline = target = None
        note = ""
        if name.startswith("replay.insert_per_s"):
            baseline = f"torchrl.insert_per_s.{layout}"
        elif name.startswith("replay.sample_per_s.inproc_prio"):
            baseline, target = f"torchrl.sample_per_s.prio.{layout}", ">= 1"
            note = "TorchRL's prioritized sampler needs its compiled extension (missing with torch 2.13.0)"
        elif name.startswith("replay.sample_per_s.inproc"):
            baseline, target = f"torchrl.sample_per_s.{layout}", ">= 1"
        elif name.startswith("replay.sample_per_s.socket"):
            baseline, target = f"torchrl.sample_per_s.{layout}", ">= 0.5"
            note = (
                "replay service process over TCP loopback, 4 requests in flight; baseline TorchRL in process"
            )
        elif name == "replay.ingest_steps_per_s.fsync":
            baseline, unit_ = "segment_log.steps_per_s.fsync", "steps/s"
            note = "gateway sink -> service -> log, fsync per group commit, until acknowledged"
            records.append(Record.median_of(name, vals, unit_, baseline=baseline, note=note))
            continue
        elif name == "segment_log.steps_per_s.fsync":
            records.append(
                Record.median_of(
                    name, vals, "steps/s", note="bare SegmentLog in process, fsync every 16 chunks"
                )
            )
            continue
        records.append(Record.median_of(name, vals, unit, baseline=baseline, target=target, note=note))
    return records


if __name__ == "__main__":  # a quick look without the bench runner
    logging.basicConfig(level="INFO")
    for record in run(quick="--quick" in sys.argv, repeats=1):
        print(f"{record.name:45s} {record.value:14,.0f} {record.unit}")
