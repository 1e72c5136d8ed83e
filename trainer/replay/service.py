"""The replay service process: durable ingest from the gateway, sampling for trainers.

Three sockets, addresses in ``endpoints.json`` under ``"replay"``:

- ``ingest`` (ROUTER, its own thread, :mod:`trainer.replay.ingest`): the gateway's
  :class:`~trainer.replay.sink.ReplaySink` sends ``TRAJECTORY_CHUNK``; the answer is
  ``CHUNK_ACK {ids}`` once the chunk is in the durable log, or a typed ``ERROR``;
- ``sample`` (ROUTER): ``SAMPLE {tables: {name: count}, timeout_s}`` is answered with a
  ``BATCH`` as soon as every named table can serve its count (rate limiters, min
  size), or with ``ERROR deadline_exceeded`` naming what it waited for;
  ``COMMAND update_priorities`` (arrays ``key``, ``priority``) and ``COMMAND status``;
- ``control`` (ROUTER): ``COMMAND status`` and ``COMMAND import {path}`` (demonstrations
  from another run folder).

Durable data lives under ``<run>/replay/`` (``log/`` segments, a ``LOCK`` held while
running). On start the tables are rebuilt from the log, then ``demos_from`` runs are
imported (once: their chunk ids are in the log afterwards). Started by ``loopgate up``
or by hand (see :mod:`trainer.replay.cli`)::

    python -m trainer.replay --config runs/x/config.yaml --run-dir runs/x
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from gateway.locks import Locked, hold, wait_to_hold
from gateway.metrics import MetricsWriter
from gateway.protocol import (
    ErrorCode,
    Message,
    MsgType,
    ProtocolError,
    error_message,
    recv_routed,
    send,
)
from gateway.services import freeze_heap
from gateway.transport import CurveKeys, bind, inproc_address
from trainer.replay.config import ReplayConfig
from trainer.replay.core import ReplayBuffer, Waiting
from trainer.replay.ingest import Ingest
from trainer.replay.log import LOG_DIR, ReplayLog

if TYPE_CHECKING:
    from gateway.config import ExperimentConfig

log = logging.getLogger(__name__)

LOCK_WAIT_S = 20.0
"""How long a starting service waits for the replay folder held by one still stopping."""

MAX_SAMPLE_TIMEOUT_S = 300.0


def lock_dir(replay_dir: Path) -> int:
    """Hold ``<replay_dir>/LOCK`` (one writer per log); raise :class:`Locked` if taken."""
    return hold(replay_dir / "LOCK", "replay service")


def open_log(cfg: ReplayConfig, run_dir: Path) -> ReplayLog:
    return ReplayLog(
        run_dir / LOG_DIR,
        fsync=cfg.fsync,
        fsync_interval_s=cfg.fsync_interval_s,
        segment_bytes=cfg.segment_bytes,
        retention_bytes=cfg.retention_bytes,
        retention_s=cfg.retention_s,
    )


def rebuild(replay_log: ReplayLog, buffer: ReplayBuffer) -> dict[str, Any]:
    """Refill the tables from the log (oldest first); return what was found."""
    started = time.monotonic()
    buffer.rebuilding = True
    chunks = 0
    for chunk in replay_log.chunks():
        chunks += 1
        buffer.insert(chunk, chunk.meta.get("source", "online"))
    buffer.restored()
    report = replay_log.report
    summary = {
        "chunks": chunks,
        "corrupt_records": report.corrupt_records,
        "corrupt_segments": list(report.corrupt_segments),
        "torn_bytes_cut": replay_log.torn_bytes_cut,
        "seconds": round(time.monotonic() - started, 3),
        "tables": {name: t.size for name, t in buffer.tables.items()},
    }
    if report.corrupt_records:
        log.error(
            "replay log: %d corrupted record(s) in segment(s) %s skipped; everything else was read",
            report.corrupt_records,
            report.corrupt_segments,
        )
    log.info("tables rebuilt from the log: %s", summary)
    return summary


@dataclass
class Parked:
    """A sample request waiting for its tables."""

    route: bytes
    seq: int
    counts: dict[str, int]
    deadline: float


class ReplayService:
    """The service: ingest thread, sample and control sockets, one loop owning the tables."""

    def __init__(
        self,
        cfg: ReplayConfig,
        run_dir: Path,
        addresses: dict[str, str],
        *,
        keys: CurveKeys | None = None,
        metrics: MetricsWriter | None = None,
        seed: int = 0,
    ) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        # One still stopping (its loopgate up killed: it drains first) is waited for.
        self._lock = wait_to_hold(run_dir / "replay" / "LOCK", "replay service", LOCK_WAIT_S, log.warning)
        self.metrics = metrics or MetricsWriter(None, "replay")
        self.ctx: zmq.Context[Any] = zmq.Context.instance()
        self.buffer = ReplayBuffer(cfg, seed=seed)
        self.log = open_log(cfg, run_dir)
        self.recovery = rebuild(self.log, self.buffer)
        self.inbox: queue.Queue[Any] = queue.Queue()
        self._wake_addr = inproc_address("replay-wake")
        self._wake_rx: zmq.Socket[Any] = self.ctx.socket(zmq.PULL)
        self._wake_rx.bind(self._wake_addr)
        self._wake_lock = threading.Lock()
        self._wake_tx: zmq.Socket[Any] = self.ctx.socket(zmq.PUSH)
        self._wake_tx.connect(self._wake_addr)
        self.overloaded = threading.Event()

        def _bind(sock: zmq.Socket[Any], address: str) -> str:
            return bind(sock, address, keys)

        self.ingest = Ingest(
            ctx=self.ctx,
            address=addresses["ingest"],
            replay_log=self.log,
            deliver=self._deliver,
            overloaded=self.overloaded,
            bind=_bind,
        )
        self.ingest.layout = self.buffer.store.layout() or None
        self.sample_sock = self._router(addresses["sample"], keys)
        self.control_sock = self._router(addresses["control"], keys)
        self.addresses = {
            "ingest": self.ingest.address,
            "sample": str(self.sample_sock.getsockopt_string(zmq.LAST_ENDPOINT)),
            "control": str(self.control_sock.getsockopt_string(zmq.LAST_ENDPOINT)),
        }
        self.parked: list[Parked] = []
        self.errors: dict[str, int] = {}
        self.batches = 0
        self.stopping = False

    def _router(self, address: str, keys: CurveKeys | None) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = self.ctx.socket(zmq.ROUTER)
        sock.linger = 0
        sock.sndhwm = 1000
        bind(sock, address, keys)
        return sock

    # ---------------------------------------------------------- cross-thread

    def _deliver(self, chunk: Message) -> None:
        """Called by the ingest thread for every chunk the log stored."""
        self._post(("chunk", chunk))

    def _post(self, item: Any) -> None:
        self.inbox.put(item)
        with self._wake_lock:
            self._wake_tx.send(b"", zmq.NOBLOCK)

    def _drain_inbox(self) -> bool:
        changed = False
        while self._wake_rx.poll(0):
            self._wake_rx.recv()
        while True:
            try:
                kind, *rest = self.inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "chunk":
                chunk = rest[0]
                self.buffer.insert(chunk, chunk.meta.get("source", "online"))
                changed = True
            elif kind == "reply":
                route, seq, meta = rest
                send(self.control_sock, Message(MsgType.REPLY, seq=seq, meta=meta), route=[route])
        return changed

    # -------------------------------------------------------------- serving

    def _error(self, sock: zmq.Socket[Any], route: bytes, exc: ProtocolError, seq: int) -> None:
        self.errors[exc.code.value] = self.errors.get(exc.code.value, 0) + 1
        send(sock, error_message(exc.code.value, exc.message, seq), route=[route])

    def _receive(self, sock: zmq.Socket[Any]) -> tuple[bytes, Message | None]:
        """One routed message, or None after answering a malformed one."""
        route, msg, err = recv_routed(sock)
        if err is not None:
            self._error(sock, route, err, 0)
        return route, msg

    def on_sample_socket(self) -> None:
        route, msg = self._receive(self.sample_sock)
        if msg is None:
            return
        try:
            if msg.type is MsgType.SAMPLE:
                self._on_sample(route, msg)
            elif msg.type is MsgType.COMMAND:
                meta = self.command(msg)
                send(self.sample_sock, Message(MsgType.REPLY, seq=msg.seq, meta=meta), route=[route])
            else:
                raise ProtocolError(
                    ErrorCode.UNEXPECTED, f"the sample socket takes SAMPLE and COMMAND, not {msg.type.name}"
                )
        except ProtocolError as exc:
            self._error(self.sample_sock, route, exc, msg.seq)

    def _on_sample(self, route: bytes, msg: Message) -> None:
        tables = msg.meta.get("tables")
        timeout = msg.meta.get("timeout_s", 1.0)
        if not isinstance(tables, dict):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "SAMPLE needs meta tables: {name: count, ...}")
        if (
            not isinstance(timeout, (int, float))
            or isinstance(timeout, bool)
            or not 0 <= timeout <= MAX_SAMPLE_TIMEOUT_S
        ):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"SAMPLE timeout_s must be in 0..{MAX_SAMPLE_TIMEOUT_S}, got {timeout!r}",
            )
        counts = {str(k): v for k, v in tables.items()}
        self.buffer.check_request(counts)
        request = Parked(route, msg.seq, counts, time.monotonic() + float(timeout))
        if not self._try_serve(request):
            self.parked.append(request)

    def _try_serve(self, request: Parked) -> bool:
        try:
            arrays = self.buffer.sample(request.counts)
        except Waiting:
            return False
        kinds = {self.buffer.tables[n].config.item for n in request.counts}
        meta = {"tables": list(request.counts), "item": kinds.pop()}
        send(
            self.sample_sock,
            Message(MsgType.BATCH, seq=request.seq, meta=meta, arrays=arrays),
            route=[request.route],
        )
        self.batches += 1
        return True

    def _serve_parked(self, changed: bool) -> None:
        if not self.parked:
            return
        now = time.monotonic()
        still = []
        for request in self.parked:
            if changed and self._try_serve(request):
                continue
            if now >= request.deadline:
                reason = self.buffer.ready(request.counts) or "the tables could not serve in time"
                exc = ProtocolError(
                    ErrorCode.DEADLINE_EXCEEDED, f"no batch within the request's timeout: {reason}"
                )
                self._error(self.sample_sock, request.route, exc, request.seq)
                continue
            still.append(request)
        self.parked = still

    def command(self, msg: Message) -> dict[str, Any]:
        cmd = msg.meta.get("cmd")
        if cmd == "status":
            return self.status()
        if cmd == "update_priorities":
            keys, prios = msg.arrays.get("key"), msg.arrays.get("priority")
            if keys is None or prios is None:
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST, "update_priorities needs arrays 'key' and 'priority'"
                )
            return {"applied": self.buffer.update_priorities(keys, prios)}
        if cmd == "release_rate_limits":
            admitted = self.buffer.release_rate_limits()
            log.info("rate limits released; %d waiting item(s) admitted", admitted)
            return {"released": True, "admitted": admitted}
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"unknown command {cmd!r} (status, update_priorities, release_rate_limits, import, demo)",
        )

    def on_control_socket(self) -> None:
        route, msg = self._receive(self.control_sock)
        if msg is None:
            return
        try:
            if msg.type is not MsgType.COMMAND:
                raise ProtocolError(
                    ErrorCode.UNEXPECTED, f"the control socket takes COMMAND, not {msg.type.name}"
                )
            if msg.meta.get("cmd") == "demo":  # answered once the take's steps are stored
                seq = msg.seq
                self.ingest.submit_job(
                    "demo", dict(msg.meta), lambda result: self._post(("reply", route, seq, result))
                )
                return
            if msg.meta.get("cmd") == "import":
                path = msg.meta.get("path")
                if not isinstance(path, str) or not Path(path).is_dir():
                    raise ProtocolError(ErrorCode.BAD_REQUEST, f"import: {path!r} is not a run folder")
                seq = msg.seq
                self.ingest.submit_job(
                    "import", path, lambda result: self._post(("reply", route, seq, result))
                )
                return
            meta = self.command(msg)
            send(self.control_sock, Message(MsgType.REPLY, seq=msg.seq, meta=meta), route=[route])
        except ProtocolError as exc:
            self._error(self.control_sock, route, exc, msg.seq)

    def status(self) -> dict[str, Any]:
        return {
            **self.buffer.state(),
            "log": self.log.state(),
            "ingest": dict(self.ingest.counters),
            "storage_error": self.ingest.storage_error,
            "overloaded": self.overloaded.is_set(),
            "parked_requests": len(self.parked),
            "batches": self.batches,
            "errors": dict(self.errors),
            "recovery": self.recovery,
        }

    # ------------------------------------------------------------------ loop

    def run(self, stop: threading.Event | None = None) -> None:
        self.ingest.start()
        poller = zmq.Poller()
        for sock in (self._wake_rx, self.sample_sock, self.control_sock):
            poller.register(sock, zmq.POLLIN)
        last_metrics = last_settle = 0.0
        log.info("replay service serving: %s", json.dumps(self.addresses))
        while not self.stopping and not (stop is not None and stop.is_set()):
            timeout = 50
            if self.parked:
                soonest = min(p.deadline for p in self.parked) - time.monotonic()
                timeout = max(0, min(timeout, int(soonest * 1000) + 1))
            events = dict(poller.poll(timeout))
            changed = self._drain_inbox() if self._wake_rx in events or not self.inbox.empty() else False
            for sock, handler in (
                (self.sample_sock, self.on_sample_socket),
                (self.control_sock, self.on_control_socket),
            ):
                if sock in events:
                    for _ in range(256):
                        handler()
                        if not sock.poll(0):
                            break
            # Samples let waiting inserts in (rate limiter), inserts let samples out.
            changed = (self.buffer.admit() > 0) or changed
            if self.buffer.overloaded():
                self.overloaded.set()
            else:
                self.overloaded.clear()
            now = time.monotonic()
            if now - last_settle >= 1.0:
                last_settle = now
                changed = (self.buffer.settle(now) > 0) or changed
            self._serve_parked(changed)
            if now - last_metrics >= self.cfg.metrics_interval_s:
                last_metrics = now
                state = self.status()
                state.pop("recovery", None)
                self.metrics.emit(state)
        log.info("replay service stopping")

    def close(self) -> None:
        self.ingest.stop()
        for sock in (self.sample_sock, self.control_sock, self._wake_rx, self._wake_tx):
            sock.close(linger=0)
        self.log.close()
        self.metrics.close()
        with contextlib.suppress(OSError):
            os.close(self._lock)


# ------------------------------------------------------------------------- main


def service_addresses(cfg: Any, run_dir: Path) -> dict[str, str]:
    """Addresses from ``endpoints.json`` (``loopgate up`` wrote them) or from the config."""
    path = run_dir / "endpoints.json"
    endpoints = json.loads(path.read_text()) if path.exists() else {}
    if "replay" in endpoints:
        return dict(endpoints["replay"])
    from gateway.services import RunContext
    from trainer.replay.plan import replay_addresses

    return replay_addresses(
        cfg, RunContext(run_dir=run_dir, config_path=run_dir / "config.yaml", endpoints={})
    )


def without_idle_limiters(cfg: ExperimentConfig) -> ReplayConfig:
    """The replay block with no samples-per-insert ratio on tables no trainer samples.

    Such a ratio waits for samples that never come: inserts would stop after the error
    buffer, the ingest would refuse chunks as rate limited, and collection would stall
    for a sampler that does not exist (``trainer.enabled: false``, or a table missing
    from ``trainer.tables``).
    """
    sampled = set(cfg.trainer.tables) if cfg.trainer.enabled else set()
    tables = []
    for table in cfg.replay.tables:
        if table.samples_per_insert is not None and table.name not in sampled:
            log.warning(
                "table %s: samples_per_insert %s is not enforced: no trainer samples it in this run "
                "(trainer.enabled: %s, trainer.tables: %s)",
                table.name,
                table.samples_per_insert,
                cfg.trainer.enabled,
                sorted(cfg.trainer.tables),
            )
            table = replace(table, samples_per_insert=None)
        tables.append(table)
    return replace(cfg.replay, tables=tables)


def serve(args: argparse.Namespace) -> int:
    from gateway.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.set)
        run_dir = Path(args.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        addresses = service_addresses(cfg, run_dir)
        keys = CurveKeys.load(cfg.gateway.curve_keys) if cfg.gateway.curve_keys else None
        service = ReplayService(
            without_idle_limiters(cfg) if args.run_trainer_only else cfg.replay,
            run_dir,
            addresses,
            keys=keys,
            metrics=MetricsWriter(run_dir / "metrics.jsonl", "replay"),
        )
    except (ConfigError, Locked, ValueError) as exc:
        log.error("%s", exc)
        return 2
    path = run_dir / "endpoints.json"
    endpoints = json.loads(path.read_text()) if path.exists() else {}
    if endpoints.get("replay") != service.addresses:
        endpoints["replay"] = service.addresses
        path.write_text(json.dumps(endpoints, indent=2))

    def _stop(signum: int, frame: Any) -> None:
        service.stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        for src in cfg.replay.demos_from:
            result = service.ingest.import_run(src)
            log.info("demos_from %s: %s", src, result)
        freeze_heap()
        service.run()
    finally:
        service.close()
    return 0
