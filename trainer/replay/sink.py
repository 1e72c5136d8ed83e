"""The gateway's trajectory sink when the replay service runs (``SINKS["replay"]``).

A DEALER to the service's ``ingest`` socket. :meth:`ReplaySink.submit` sends a chunk
(its arrays straight from their memory) and keeps it until the service acknowledges it
as durable; :meth:`poll_acks` reports those ids to the recorder, which then trims its
spool. Unacknowledged chunks are sent again after ``resend_timeout_s``, after the
socket reconnects (the service restarted) and after a refusal's back-off; the service
stores a chunk id once, so resending is always safe.

Backpressure: while the service refuses (``storage``: its disk is full;
``rate_limited``: the trainer is behind) or more than ``max_backlog_chunks`` chunks wait
for acknowledgement, :attr:`blocked` is true and the gateway stops giving actions to
env workers; their steps so far are safe in the gateway's spool::

    sink = ReplaySink.from_config(cfg, run_dir, endpoints)   # endpoints["replay"]["ingest"]
    sink.submit(chunk)
    acked = sink.poll_acks()
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import zmq

from gateway.log_every import LogEvery
from gateway.protocol import Message, MsgType, ProtocolError, recv, send
from gateway.store import TrajectorySink
from gateway.transport import CurveKeys, connect

log = logging.getLogger(__name__)

REFUSALS = ("storage", "rate_limited", "unavailable")
"""Error codes that mean "not now": the chunk is resent after ``storage_retry_s``."""
REFUSAL_LOG_S = 30.0
"""A refusal of the same kind is logged (with the recovery after it) at most once in this
long. Under a samples-per-insert ratio the service refuses and takes chunks again many
times a minute as a matter of course: logging each turn filled the gateway's log."""


class ReplaySink(TrajectorySink):
    """Chunks to the replay service's ingest socket, acknowledged once durable there."""

    def __init__(
        self,
        address: str,
        *,
        keys: CurveKeys | None = None,
        max_backlog_chunks: int = 256,
        resend_timeout_s: float = 2.0,
        retry_s: float = 1.0,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.address = address
        self.max_backlog = max_backlog_chunks
        self.resend_timeout_s = resend_timeout_s
        self.retry_s = retry_s
        self._ctx = context or zmq.Context.instance()
        self.sock: zmq.Socket[Any] = self._ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.sndhwm = 100_000
        self.sock.rcvhwm = 100_000
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED)
        self.keys = keys
        connect(self.sock, address, keys)
        self._unacked: OrderedDict[str, tuple[Message, float]] = OrderedDict()
        """Chunk id -> (chunk, monotonic time sent; 0.0 = not sent yet)."""
        self._acked: list[str] = []
        self._refused_until = 0.0
        self.refusal: str | None = None
        self.refusal_log = LogEvery(REFUSAL_LOG_S)
        """Which refusals are logged (one of a kind in ``REFUSAL_LOG_S``)."""
        self._recovery_due = False
        """A refusal was logged, so the recovery after it will be."""
        self.counters = {"sent": 0, "resent": 0, "acked": 0, "refused": 0, "bad": 0, "reconnects": 0}
        self._seq = 0

    @classmethod
    def from_config(cls, cfg: Any, run_dir: Path, endpoints: dict[str, Any]) -> ReplaySink:
        replay = endpoints.get("replay")
        if not replay or "ingest" not in replay:
            raise ValueError(
                "replay.enabled is true but endpoints.json has no replay.ingest address "
                "(start the run with `loopgate up`, or the replay service first)"
            )
        r = cfg.replay
        keys = CurveKeys.load(cfg.gateway.curve_keys) if cfg.gateway.curve_keys else None
        return cls(
            replay["ingest"],
            keys=keys,
            max_backlog_chunks=r.max_backlog_chunks,
            resend_timeout_s=r.resend_timeout_s,
            retry_s=r.storage_retry_s,
        )

    # ------------------------------------------------------------ interface

    def submit(self, chunk: Message) -> None:
        cid = chunk.meta["chunk_id"]
        if cid in self._unacked:
            return
        self._unacked[cid] = (chunk, 0.0)
        if not self._refusing():
            self._send(cid, chunk)

    def poll_acks(self) -> list[str]:
        while self.sock.poll(0):
            try:
                msg = recv(self.sock)
            except ProtocolError as exc:
                log.error("replay service sent a message that does not decode: %s", exc)
                continue
            if msg.type is MsgType.CHUNK_ACK:
                for cid in msg.meta.get("ids", []):
                    if self._unacked.pop(cid, None) is not None:
                        self._acked.append(cid)
                        self.counters["acked"] += 1
                if self.refusal is not None and msg.meta.get("ids"):
                    if self._recovery_due:
                        log.info("replay service acknowledges chunks again (after %s)", self.refusal)
                        self._recovery_due = False
                    self.refusal = None
            elif msg.type is MsgType.ERROR:
                self._on_error(msg)
        acked, self._acked = self._acked, []
        return acked

    def _on_error(self, msg: Message) -> None:
        code = str(msg.meta.get("code"))
        cid = msg.meta.get("chunk_id")
        if code in REFUSALS:
            self.counters["refused"] += 1
            if self.refusal is None:
                self._log_refusal(code, str(msg.meta.get("message")))
            self.refusal = code
            self._refused_until = time.monotonic() + self.retry_s
            if isinstance(cid, str) and cid in self._unacked:
                self._unacked[cid] = (self._unacked[cid][0], 0.0)  # resend after the back-off
            return
        # A chunk the service calls malformed stays in the backlog (and the spool): it
        # is a bug to fix, not data to drop.
        self.counters["bad"] += 1
        log.error("replay service refused chunk %s: [%s] %s", cid, code, msg.meta.get("message"))

    def _log_refusal(self, code: str, message: str) -> None:
        """A new refusal: logged unless one of the same kind was, less than
        :data:`REFUSAL_LOG_S` ago (then it is counted for the next line)."""
        held = self.refusal_log.passes(code)
        if held is None:
            return
        earlier = f"; held back {held} more time(s) since the last such line" if held else ""
        # A ratio holding collection back is the table working as configured; a full disk is not.
        level = logging.INFO if code == "rate_limited" else logging.WARNING
        log.log(level, "replay service refuses chunks (%s): %s; holding them%s", code, message, earlier)
        self._recovery_due = True

    def follow(self, endpoints: dict[str, Any]) -> list[str]:
        """Re-point the socket if ``endpoints``' ``replay.ingest`` changed (the service
        restarted on another node): every unacknowledged chunk is sent there once it
        connects. The move, in words."""
        new = (endpoints.get("replay") or {}).get("ingest")
        if not isinstance(new, str) or new == self.address:
            return []
        old, self.address = self.address, new
        with contextlib.suppress(zmq.ZMQError):  # not connected there any more
            self.sock.disconnect(old)
        connect(self.sock, new, self.keys)
        log.warning("replay ingest moved: %s -> %s; %d chunk(s) go there", old, new, len(self._unacked))
        return [f"replay ingest: {old} -> {new}"]

    def backlog(self) -> int:
        return len(self._unacked)

    @property
    def blocked(self) -> bool:
        """The gateway should stop collecting: the service refused and has not acknowledged
        anything since, or too much is unacknowledged."""
        return self.refusal is not None or len(self._unacked) > self.max_backlog

    def _refusing(self) -> bool:
        return self.refusal is not None and time.monotonic() < self._refused_until

    def sockets(self) -> list[Any]:
        return [self.sock]

    def tick(self) -> None:
        reconnected = False
        while self._monitor.poll(0):
            self._monitor.recv_multipart()
            reconnected = True
        if reconnected and self.counters["sent"]:
            self.counters["reconnects"] += 1
            log.info("replay ingest (re)connected; resending %d unacknowledged chunk(s)", len(self._unacked))
        if self._refusing():
            return
        now = time.monotonic()
        for cid, (chunk, sent) in list(self._unacked.items()):
            if reconnected or sent == 0.0 or now - sent >= self.resend_timeout_s:
                if sent:
                    self.counters["resent"] += 1
                self._send(cid, chunk)

    def _send(self, cid: str, chunk: Message) -> None:
        self._seq += 1
        chunk.seq = self._seq
        try:
            send(self.sock, chunk, flags=zmq.NOBLOCK)
        except zmq.Again:
            return  # queue full: the next tick tries again
        self._unacked[cid] = (chunk, time.monotonic())
        self.counters["sent"] += 1

    def describe(self) -> str:
        state = f", refusing ({self.refusal})" if self._refusing() else ""
        return f"replay service {self.address}{state}"

    def close(self) -> None:
        self._monitor.close(linger=0)
        self.sock.close(linger=0)
