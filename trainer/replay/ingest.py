"""The ingest side of the replay service: chunks from the gateway into the durable log.

Runs in its own thread with its own ROUTER socket, so an fsync never holds up
sampling. For each group of chunks that arrived together it validates every chunk
(a malformed one is answered with an ERROR naming the problem), appends the new ones
to the :class:`~trainer.replay.log.ReplayLog`, commits once, and only then answers
``CHUNK_ACK {ids}``; chunks seen before are acknowledged again and stored once. The
stored chunks go to the service loop, which inserts them into the tables.

Refusals are typed, and the gateway's sink waits and resends:

- ``storage``: the disk refused the write (full, quota, I/O error); nothing of the
  group is acknowledged, and every later group tries the disk again;
- ``rate_limited``: the tables hold more items waiting for their rate limiters than
  ``max_pending`` (the trainer is behind): new chunks wait at the gateway.

Demonstrations are imported here too (``import_run``), and the console's recorded
takes stored as demonstrations (``demo``, :mod:`trainer.replay.demos`), so one thread
owns the log.
"""

from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from gateway.protocol import (
    ErrorCode,
    Limits,
    Message,
    MsgType,
    ProtocolError,
    error_message,
    recv_routed,
    send,
)
from gateway.trajectory import chunk_id, validate_chunk
from trainer.replay.demos import parse_request, take_chunks
from trainer.replay.log import ReplayLog, run_chunks
from trainer.replay.storage import Layout, check_arrays

log = logging.getLogger(__name__)

GROUP_MAX = 256
"""Most chunks committed as one group."""
RETENTION_EVERY_S = 5.0
DEMO_WAIT_S = 30.0
"""How long a ``demo`` command waits for the take's steps to reach the log."""
DEMO_RETRY_S = 0.25
"""How often a waiting ``demo`` command looks for its steps again."""
INGEST_LIMITS = Limits(max_frames=4096, max_frame_bytes=1 << 30, max_message_bytes=2 << 30)


def as_demo(chunk: Message, origin: str) -> Message:
    """A copy of ``chunk`` as an imported demonstration: ids prefixed by its run's name."""
    meta = dict(chunk.meta)
    episode = f"demo:{origin}:{meta['episode_id']}"
    meta.update(episode_id=episode, chunk_id=chunk_id(episode, meta["first_step"]), source="demos")
    return Message(MsgType.TRAJECTORY_CHUNK, meta=meta, arrays=chunk.arrays)


def demo_chunks(src: str | Path) -> list[Message]:
    """Every non-evaluation chunk of run folder ``src``, as demonstrations."""
    origin = Path(src).resolve().name
    out = []
    for chunk in run_chunks(src):
        if chunk.meta.get("eval") or chunk.meta.get("source", "online") != "online":
            continue
        validate_chunk(chunk)
        check_arrays(chunk, None)
        out.append(as_demo(chunk, origin))
    return out


class Ingest(threading.Thread):
    """The ingest thread; ``deliver(chunk)`` hands stored chunks to the service loop."""

    def __init__(
        self,
        *,
        ctx: zmq.Context[Any],
        address: str,
        replay_log: ReplayLog,
        deliver: Callable[[Message], None],
        overloaded: threading.Event,
        bind: Callable[[zmq.Socket[Any], str], str],
    ) -> None:
        super().__init__(name="replay-ingest", daemon=True)
        self.log = replay_log
        self.deliver = deliver
        self.overloaded = overloaded
        self.sock: zmq.Socket[Any] = ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.rcvhwm = 10_000
        self.sock.sndhwm = 10_000
        self.address = bind(self.sock, address)
        self.jobs: queue.Queue[tuple[str, Any, Callable[[dict[str, Any]], None]]] = queue.Queue()
        self.stopping = threading.Event()
        self.counters = {
            "chunks": 0,
            "steps": 0,
            "duplicates": 0,
            "malformed": 0,
            "refused_storage": 0,
            "refused_rate_limited": 0,
        }
        self.storage_error: str | None = None
        self.layout: Layout | None = None
        """Dtypes and per-step shapes of the stored steps, from the first chunk."""
        self._logged: set[tuple[bytes, str]] = set()
        self._last_retention = time.monotonic()
        self._waiting: list[tuple[float, dict[str, Any], Callable[[dict[str, Any]], None]]] = []
        """Demo jobs waiting for their steps: (deadline, request, done)."""
        self._retry_at = 0.0

    # --------------------------------------------------------------- loop

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                if self.sock.poll(50):
                    self._serve_group()
                self._run_jobs()
                now = time.monotonic()
                if now - self._last_retention >= RETENTION_EVERY_S:
                    self._last_retention = now
                    self.log.retain()
        finally:
            self.sock.close(linger=0)

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=10)

    def _answer(self, route: bytes, exc: ProtocolError, seq: int, chunk: str | None = None) -> None:
        if (route, exc.code.value) not in self._logged:
            self._logged.add((route, exc.code.value))
            log.warning(
                "peer %s: %s (further %s errors from it are counted)", route.hex()[:8], exc, exc.code.value
            )
        msg = error_message(exc.code.value, exc.message, seq)
        if chunk is not None:
            msg.meta["chunk_id"] = chunk
        send(self.sock, msg, route=[route])

    def _serve_group(self) -> None:
        group: list[tuple[bytes, Message]] = []
        for _ in range(GROUP_MAX):
            route, msg, err = recv_routed(self.sock, INGEST_LIMITS)
            if err is not None:
                self.counters["malformed"] += 1
                self._answer(route, err, 0)
            elif msg is not None:
                self._check(route, msg, group)
            if not self.sock.poll(0):
                break
        if group:
            self._store(group)

    def _check(self, route: bytes, msg: Message, group: list[tuple[bytes, Message]]) -> None:
        cid = msg.meta.get("chunk_id") if isinstance(msg.meta.get("chunk_id"), str) else None
        try:
            if msg.type is MsgType.COMMAND and msg.meta.get("cmd") == "ping":
                send(self.sock, Message(MsgType.REPLY, seq=msg.seq, meta={"ok": True}), route=[route])
                return
            validate_chunk(msg)
            self.layout = check_arrays(msg, self.layout)
            if msg.meta.get("source", "online") != "online":
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST, "trajectory chunk: the ingest socket takes online chunks only"
                )
        except ProtocolError as exc:
            self.counters["malformed"] += 1
            self._answer(route, exc, msg.seq, cid)
            return
        group.append((route, msg))

    def _store(self, group: list[tuple[bytes, Message]]) -> None:
        fresh = [(r, m) for r, m in group if m.meta["chunk_id"] not in self.log.ids]
        if fresh and self.overloaded.is_set():
            self.counters["refused_rate_limited"] += len(fresh)
            exc = ProtocolError(
                ErrorCode.RATE_LIMITED,
                "replay tables hold more items waiting for their rate limiters than max_pending; "
                "the trainer is behind, resend later",
            )
            for route, msg in fresh:
                self._answer(route, exc, msg.seq, msg.meta["chunk_id"])
            group = [(r, m) for r, m in group if m.meta["chunk_id"] in self.log.ids]
            if not group:
                return
        try:
            new, dups = self.log.append_group(m for _, m in group)
        except OSError as exc:
            self.counters["refused_storage"] += len(group)
            reason = errno.errorcode.get(exc.errno or 0, str(exc.errno))
            if self.storage_error is None:
                log.error(
                    "replay log refused a write (%s: %s); refusing chunks until it succeeds",
                    reason,
                    exc.strerror,
                )
            self.storage_error = f"{reason}: {exc.strerror}"
            err = ProtocolError(
                ErrorCode.STORAGE, f"replay log cannot store chunks ({self.storage_error}); resend later"
            )
            for route, msg in group:
                self._answer(route, err, msg.seq, msg.meta["chunk_id"])
            return
        if self.storage_error is not None:
            log.info("replay log stores chunks again (after %s)", self.storage_error)
            self.storage_error = None
        for chunk in new:
            self.deliver(chunk)
        self.counters["chunks"] += len(new)
        self.counters["steps"] += sum(int(m.meta["num_steps"]) for m in new)
        self.counters["duplicates"] += len(dups)
        acks: dict[bytes, list[str]] = {}
        for route, msg in group:
            acks.setdefault(route, []).append(msg.meta["chunk_id"])
        for route, ids in acks.items():
            send(self.sock, Message(MsgType.CHUNK_ACK, meta={"ids": ids}), route=[route])

    # --------------------------------------------------------------- jobs

    def submit_job(self, kind: str, arg: Any, done: Callable[[dict[str, Any]], None]) -> None:
        """Run ``kind`` (``import``) on this thread; ``done(result)`` is called from it."""
        self.jobs.put((kind, arg, done))

    def _run_jobs(self) -> None:
        now = time.monotonic()
        if self._waiting and now >= self._retry_at:  # demos whose steps were still on their way
            self._retry_at = now + DEMO_RETRY_S
            waiting, self._waiting = self._waiting, []
            for deadline, arg, done in waiting:
                self._demo(arg, done, deadline, now)
        while True:
            try:
                kind, arg, done = self.jobs.get_nowait()
            except queue.Empty:
                return
            if kind == "demo":
                self._demo(arg, done, now + float(arg.get("wait_s", DEMO_WAIT_S)), now)
                continue
            try:
                result = self.import_run(arg) if kind == "import" else {"error": f"unknown job {kind}"}
            except (OSError, ProtocolError, KeyError) as exc:
                result = {"error": f"{type(exc).__name__}: {exc}"}
            done(result)

    def _demo(
        self, meta: dict[str, Any], done: Callable[[dict[str, Any]], None], deadline: float, now: float
    ) -> None:
        """Store a console take as demonstrations once all its steps are in the log."""
        try:
            request = parse_request(meta)
            chunks = take_chunks(request, self.log.episode_chunks)
            if isinstance(chunks, str):
                if now < deadline:
                    self._waiting.append((deadline, meta, done))
                    return
                raise ProtocolError(ErrorCode.UNAVAILABLE, f"demo {request.take}: {chunks}")
            for chunk in chunks:
                validate_chunk(chunk)
            new, dups = self.log.append_group(chunks)
        except ProtocolError as exc:
            done({"error": exc.message, "code": exc.code.value})
            return
        except OSError as exc:
            done({"error": f"the replay log cannot store the demo: {exc}", "code": "storage"})
            return
        for chunk in new:
            self.deliver(chunk)
        steps = sum(int(c.meta["num_steps"]) for c in chunks)
        log.info(
            "take %s stored as %d demo episode(s), %d steps (%s)",
            request.take,
            len(chunks),
            steps,
            request.label,
        )
        done(
            {
                "take": request.take,
                "episodes": [c.meta["episode_id"] for c in chunks],
                "steps": steps,
                "label": request.label,
                "already_stored": len(dups),
            }
        )

    def import_run(self, src: str | Path) -> dict[str, Any]:
        return import_into(self.log, src, self.deliver)


def import_into(replay_log: ReplayLog, src: str | Path, deliver: Callable[[Message], None]) -> dict[str, Any]:
    """Append run ``src``'s episodes to ``replay_log`` as demonstrations (idempotent)."""
    chunks = demo_chunks(src)
    new, dups = replay_log.append_group(chunks)
    for chunk in new:
        deliver(chunk)
    episodes = len({c.meta["episode_id"] for c in chunks})
    log.info("imported %s: %d episodes, %d new chunks, %d already there", src, episodes, len(new), len(dups))
    return {
        "source": str(src),
        "episodes": episodes,
        "chunks": len(new),
        "steps": sum(int(c.meta["num_steps"]) for c in new),
        "already_imported": len(dups),
    }
