"""The gateway's action source for inference servers: load balancing, retries, rejoining.

Registered as ``SOURCES["inference"]`` (``policy.kind: inference``); the gateway builds
it with :meth:`InferenceSource.from_config` from ``endpoints.json``'s ``inference``
list and uses it like any :class:`~gateway.policies.ActionSource`::

    source = InferenceSource.from_config(cfg, spec, endpoints)
    source.submit(key, obs, deadline)            # obs: {key: [K, ...]}, may be read-only
    for key, actions, versions, error in source.results(): ...

One DEALER socket per server. Each request goes to the live server with the least
outstanding work (rows in flight); its attempt carries a deadline (the sooner of the
gateway's and ``inference.deadline_ms``). A server that answers nothing for
``replica_timeout_s`` while it owes answers, or whose socket refuses a send (it is not
connected), is marked down and everything in flight on it is sent to another; a
``deadline_exceeded`` or ``unavailable`` answer is retried elsewhere too. Answers are
matched by a per-attempt sequence number, so a late answer from a server that was
given up on is dropped, never delivered twice. Heartbeats go to every server, down
ones included, so a server that comes back (restarted at its address, or planned but
started late) joins live; :meth:`InferenceSource.add_replica` adds a new one, and
:meth:`InferenceSource.follow` moves one whose address changed in ``endpoints.json``
(restarted on another node: :mod:`gateway.endpoints`).
Only when the gateway's own deadline passes does a request end with an error (the
gateway then asks again), so no env step is lost to a dying server.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from gateway.config import ConfigError
from gateway.cuda_handles import same_device
from gateway.episode import EnvSpec, Obs
from gateway.policies import ActionSource
from gateway.protocol import ErrorCode, Limits, Message, MsgType, ProtocolError, pack, recv, send
from gateway.transport import CurveKeys, connect, make_socket

log = logging.getLogger(__name__)

RETRYABLE = {ErrorCode.DEADLINE_EXCEEDED.value, ErrorCode.UNAVAILABLE.value}
STALE_WAIT_S = 30.0
"""How long the gateway waits for a server at the newest version before it accepts that
every server is behind it (a rollback) and acts with the newest one they serve."""
LATENCY_WINDOW_S = 5.0
"""The request latencies :meth:`InferenceSource.describe`'s p99 is taken over: the recent
past, so the autoscaler sees the load now, not the run's history."""
Result = tuple[Any, np.ndarray | None, np.ndarray | None, str | None]


class LatencyWindow:
    """Request latencies of the last ``window_s`` seconds (at most ``maxlen`` of them), with
    the rows each request carried: their p99, and the rows in flight on average (Little's
    law: the rows times the latency of each answer, over the time the window covers)."""

    def __init__(
        self, window_s: float = LATENCY_WINDOW_S, maxlen: int = 4096, since: float | None = None
    ) -> None:
        self.window_s = window_s
        self.maxlen = maxlen
        self._samples: deque[tuple[float, float, int]] = deque()
        self._since = time.monotonic() if since is None else since
        """Where the record starts: when measuring began, or the last answer left out for
        ``maxlen``. The average is taken over the window's part after it."""

    def add(self, now: float, latency_s: float, rows: int = 0) -> None:
        if len(self._samples) >= self.maxlen:
            self._since = max(self._since, self._samples.popleft()[0])
        self._samples.append((now, latency_s, rows))

    def _expire(self, now: float) -> None:
        while self._samples and now - self._samples[0][0] > self.window_s:
            self._samples.popleft()

    def p99_ms(self, now: float) -> float | None:
        """The 99th percentile in milliseconds, or ``None`` when nothing was answered lately."""
        self._expire(now)
        if not self._samples:
            return None
        return float(np.percentile([s for _, s, _ in self._samples], 99)) * 1e3

    def rows_in_flight(self, now: float, unanswered: float = 0.0) -> float:
        """The rows in flight on average over the window; ``unanswered``: the rows times the
        time so far of requests not answered yet. Unlike the count at one instant, it does
        not read 0 between the short requests of a steady light load."""
        self._expire(now)
        span = now - max(now - self.window_s, self._since)
        if span <= 0:
            return 0.0
        return (sum(rows * latency for _, latency, rows in self._samples) + unanswered) / span


@dataclass
class Pending:
    """One gateway request until it is answered or its gateway deadline passes."""

    key: Any
    obs: Obs
    rows: int
    deadline: float
    deterministic: np.ndarray | None = None
    """Rows that must get the deterministic action (evaluation episodes)."""
    device_obs: dict[str, Any] | None = None
    """A CUDA IPC handle of ``obs`` on the worker's GPU: sent instead of the arrays to a
    server that declared that GPU (:mod:`gateway.cuda_ipc`)."""
    attempts: int = 0
    tried: set[int] = field(default_factory=set)


@dataclass
class Replica:
    """One server as this gateway sees it."""

    index: int
    address: str
    sock: zmq.Socket[Any]
    up: bool = False
    last_heard: float = 0.0
    last_ping: float = 0.0
    version: int = 0
    queue_rows: int = 0
    inflight: dict[int, tuple[Pending, float, float]] = field(default_factory=dict)
    """Attempt seq -> (request, attempt deadline, monotonic time sent)."""
    rows: int = 0
    answered: int = 0
    downs: int = 0
    latency: LatencyWindow = field(default_factory=LatencyWindow)
    cuda: dict[str, Any] | None = None
    """The GPU the server takes CUDA IPC handles for (``{host, uuid, device}``, from its
    heartbeats); None: host arrays only."""
    cuda_failed: bool = False
    """The server refused a handle it had declared it takes: host arrays from then on."""
    moved_at_seq: int | None = None
    """Set when the server moved (:meth:`InferenceSource.follow`): the last seq sent before.
    An answer to anything up to it comes from the old server (queued in the socket, or its
    dying connection) and is dropped: taking it for the new server's would mark the
    replica up before its new connection exists, and what is then sent goes down the old
    one, lost."""

    def describe(self, now: float | None = None) -> dict[str, Any]:
        now = time.monotonic() if now is None else now
        p99 = self.latency.p99_ms(now)
        window = self.latency.window_s
        unanswered = sum(p.rows * min(now - sent, window) for p, _, sent in self.inflight.values())
        return {
            "address": self.address,
            "up": self.up,
            "version": self.version,
            "inflight_rows": self.rows,
            "inflight_rows_avg": round(self.latency.rows_in_flight(now, unanswered), 3),
            "answered": self.answered,
            "downs": self.downs,
            "latency_p99_ms": None if p99 is None else round(p99, 3),
            "cuda_ipc": self.cuda is not None and not self.cuda_failed,
        }


class InferenceSource(ActionSource):
    """Actions from one or more inference servers, balanced by least outstanding work
    (equally loaded ones in turn)."""

    def __init__(
        self,
        targets: Sequence[str | Mapping[str, Any]],
        *,
        deadline_ms: float = 1000.0,
        heartbeat_s: float = 0.25,
        replica_timeout_s: float = 1.5,
        deterministic: bool | None = None,
        keys: CurveKeys | None = None,
        limits: Limits | None = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.deadline_s = deadline_ms / 1e3
        self.heartbeat_s, self.replica_timeout_s = heartbeat_s, replica_timeout_s
        self.deterministic = deterministic
        self.keys, self.limits = keys, limits or Limits()
        self._ctx = context or zmq.Context.instance()
        self.replicas: list[Replica] = []
        self.waiting: list[Pending] = []
        self._done: list[Result] = []
        self._seq = 0
        self._turn = 0
        """Where :meth:`_pick` starts looking among equally loaded replicas."""
        self.counters = {
            "submitted": 0,
            "answered": 0,
            "retried": 0,
            "failed": 0,
            "late_dropped": 0,
            "stale_dropped": 0,
            "device_requests": 0,
        }
        self.newest_seen = 0
        """The newest policy version any replica served: a replica behind it (restarted with
        its initial weights) gets no requests until it catches up, so the acting policy never
        goes back (unless every replica stays behind for ``STALE_WAIT_S``: a rollback)."""
        self._all_behind_since: float | None = None
        self.latency = LatencyWindow()
        """Every replica's answers together: the latency the gateway sees (autoscaling)."""
        for target in targets:
            self.add_replica(target)

    @classmethod
    def from_config(cls, cfg: Any, spec: EnvSpec, endpoints: Mapping[str, Any]) -> InferenceSource:
        icfg = cfg.inference
        if not icfg.enabled:
            raise ConfigError("policy.kind is 'inference' but inference.enabled is false")
        targets = endpoints.get("inference") or []
        if not targets:
            raise ConfigError("policy.kind is 'inference' but endpoints.json lists no inference servers")
        keys = CurveKeys.load(cfg.gateway.curve_keys) if cfg.gateway.curve_keys else None
        return cls(
            targets,
            deadline_ms=icfg.deadline_ms,
            heartbeat_s=icfg.heartbeat_s,
            replica_timeout_s=icfg.replica_timeout_s,
            keys=keys,
            limits=cfg.gateway.limits,
        )

    def add_replica(self, target: str | Mapping[str, Any]) -> None:
        """Start using another server (its ``requests`` address); it joins once it answers."""
        address = target if isinstance(target, str) else str(target["requests"])
        # immediate: a send to a server that is not connected fails now instead of queueing.
        sock = make_socket(self._ctx, zmq.DEALER, sndhwm=1000, rcvhwm=10_000)
        sock.immediate = True
        connect(sock, address, self.keys)
        self.replicas.append(Replica(index=len(self.replicas), address=address, sock=sock))

    def follow(self, endpoints: Mapping[str, Any]) -> list[str]:
        """Re-point every replica whose ``requests`` address in ``endpoints`` changed (its
        server restarted on another node); what is in flight on it goes elsewhere, and it
        joins again once the server answers at its new address. The moves, in words."""
        moved = []
        for replica, entry in zip(self.replicas, endpoints.get("inference") or []):
            new = entry if isinstance(entry, str) else (entry or {}).get("requests")
            if not isinstance(new, str) or new == replica.address:
                continue
            old = replica.address
            with contextlib.suppress(zmq.ZMQError):  # not connected there any more
                replica.sock.disconnect(old)
            connect(replica.sock, new, self.keys)
            self._mark_down(replica, f"it moved to {new}")
            replica.address, replica.last_heard, replica.moved_at_seq = new, 0.0, self._seq
            replica.cuda, replica.cuda_failed = None, False
            moved.append(f"inference server {replica.index}: {old} -> {new}")
            log.warning("inference server %d moved: %s -> %s; reconnecting", replica.index, old, new)
        return moved

    # ------------------------------------------------------------- the contract

    takes_device_obs = True

    def submit(
        self,
        key: Any,
        obs: Obs,
        deadline: float,
        deterministic: np.ndarray | None = None,
        device_obs: dict[str, Any] | None = None,
    ) -> None:
        rows = len(next(iter(obs.values())))
        self.counters["submitted"] += 1
        flags = None if deterministic is None else np.asarray(deterministic, dtype=bool)
        self._dispatch(
            Pending(
                key=key, obs=obs, rows=rows, deadline=deadline, deterministic=flags, device_obs=device_obs
            )
        )

    def results(self) -> list[Result]:
        for replica in self.replicas:
            self._drain(replica)
        self._check(time.monotonic())
        done, self._done = self._done, []
        return done

    def sockets(self) -> list[Any]:
        return [r.sock for r in self.replicas]

    def tick(self) -> None:
        now = time.monotonic()
        for replica in self.replicas:
            self._drain(replica)  # liveness below must see answers already here
            if now - replica.last_ping >= self.heartbeat_s:
                replica.last_ping = now
                self._seq += 1  # the server echoes it: which connection an answer came from
                self._send(replica, Message(MsgType.HEARTBEAT, seq=self._seq))
        self._check(now)

    @property
    def version(self) -> int:
        return max((r.version for r in self.replicas), default=0)

    def describe(self) -> dict[str, Any]:
        now = time.monotonic()
        p99 = self.latency.p99_ms(now)
        return {
            "kind": "inference",
            "version": self.version,
            "replicas": [r.describe(now) for r in self.replicas],
            "waiting": len(self.waiting),
            "latency_p99_ms": None if p99 is None else round(p99, 3),
            "deadline_ms": self.deadline_s * 1e3,
            **self.counters,
        }

    def close(self) -> None:
        for replica in self.replicas:
            replica.sock.close(linger=0)

    # ---------------------------------------------------------------- internals

    def _send(self, replica: Replica, msg: Message) -> bool:
        try:
            send(replica.sock, msg, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:  # not connected (or hopelessly backed up)
            return False

    def _current(self) -> list[Replica]:
        """Live replicas serving the newest version seen (or every live one, once all of
        them have stayed behind it for ``STALE_WAIT_S``: an operator's rollback)."""
        live = [r for r in self.replicas if r.up]
        current = [r for r in live if r.version >= self.newest_seen]
        now = time.monotonic()
        if current or not live:
            self._all_behind_since = None
            return current
        if self._all_behind_since is None:
            self._all_behind_since = now
            log.warning(
                "every inference server serves a version below %d (restarted?); waiting up to %.0f s "
                "for a newer publication before acting with an older policy",
                self.newest_seen,
                STALE_WAIT_S,
            )
        if now - self._all_behind_since < STALE_WAIT_S:
            return []
        self.newest_seen = max(r.version for r in live)
        log.warning("no server caught up; acting with version %d from now on (a rollback)", self.newest_seen)
        return [r for r in live if r.version >= self.newest_seen]

    def _pick(self, pending: Pending) -> Replica | None:
        """The replica with the least outstanding work; equally loaded ones take turns (one
        request in flight at a time finds them all idle: the first would otherwise take
        every request, and a replica added for latency none)."""
        live = self._current()
        fresh = [r for r in live if r.index not in pending.tried] or live
        if not fresh:
            return None
        self._turn = (self._turn + 1) % len(fresh)
        return min(fresh[self._turn :] + fresh[: self._turn], key=lambda r: r.rows + r.queue_rows)

    def _dispatch(self, pending: Pending) -> None:
        now = time.monotonic()
        if now >= pending.deadline:  # a server would answer too late for the gateway
            self._fail(pending, f"gateway deadline passed {now - pending.deadline:.3f} s before it was sent")
            return
        while True:
            replica = self._pick(pending)
            if replica is None:
                self.waiting.append(pending)
                return
            self._seq += 1
            attempt_deadline = min(pending.deadline, now + self.deadline_s)
            meta: dict[str, Any] = {"deadline_ms": max(1.0, (attempt_deadline - now) * 1e3)}
            if self.deterministic is not None:
                meta["deterministic"] = self.deterministic
            if self._on_device(replica, pending):
                meta["cuda_ipc"] = pending.device_obs  # the same observations, read in place there
                arrays = {}
            else:
                arrays = pack("obs", pending.obs)
            if pending.deterministic is not None:
                arrays["deterministic"] = pending.deterministic
            msg = Message(MsgType.INFER, seq=self._seq, meta=meta, arrays=arrays)
            if self._send(replica, msg):
                pending.attempts += 1
                pending.tried.add(replica.index)
                self.counters["device_requests"] += "cuda_ipc" in meta
                replica.inflight[self._seq] = (pending, attempt_deadline, now)
                replica.rows += pending.rows
                return
            self._mark_down(replica, "its socket is not connected")

    def _drain(self, replica: Replica) -> None:
        while True:
            try:
                msg = recv(replica.sock, self.limits, zmq.NOBLOCK)
            except zmq.Again:
                return
            except ProtocolError as exc:
                log.warning("garbled answer from %s: %s", replica.address, exc)
                continue
            if replica.moved_at_seq is not None:
                if msg.seq <= replica.moved_at_seq:  # the old server's: see Replica.moved_at_seq
                    self.counters["late_dropped"] += 1
                    continue
                replica.moved_at_seq = None
            replica.last_heard = time.monotonic()
            if msg.type is MsgType.HEARTBEAT:  # before the requests waiting for it go out
                declared = msg.meta.get("cuda_ipc")
                replica.cuda = declared if isinstance(declared, dict) else None
            if not replica.up:
                replica.up = True
                log.info("inference server %s is up", replica.address)
                self._flush_waiting()
            if "version" in msg.meta and isinstance(msg.meta["version"], int):
                behind = replica.version < self.newest_seen
                replica.version = msg.meta["version"]
                self.newest_seen = max(self.newest_seen, replica.version)
                if behind and replica.version >= self.newest_seen and self.waiting:
                    self._flush_waiting()  # it caught up: what waited for a current server goes
            if msg.type is MsgType.HEARTBEAT:
                replica.queue_rows = int(msg.meta.get("queue_rows", 0))
                continue
            entry = replica.inflight.pop(msg.seq, None)
            if entry is None:
                self.counters["late_dropped"] += 1
                continue
            pending, _, sent = entry
            replica.rows -= pending.rows
            code = msg.meta.get("code") if msg.type is MsgType.ERROR else None
            if msg.type is MsgType.ACTION or code == ErrorCode.DEADLINE_EXCEEDED.value:
                # An answer past its deadline is the overload the autoscaler must see too.
                now = time.monotonic()
                replica.latency.add(now, now - sent, pending.rows)
                self.latency.add(now, now - sent, pending.rows)
            if msg.type is MsgType.ACTION and replica.version < self.newest_seen:
                # Acted with an older policy than one already out: ask a current server.
                self.counters["stale_dropped"] += 1
                self._retry(
                    pending, f"{replica.address} serves version {replica.version} < {self.newest_seen}"
                )
            elif msg.type is MsgType.ACTION:
                replica.answered += 1
                self.counters["answered"] += 1
                self._done.append((pending.key, msg.arrays["action"], msg.arrays["policy_version"], None))
            elif msg.type is MsgType.ERROR and msg.meta.get("code") in RETRYABLE:
                self._retry(pending, f"{replica.address}: {msg.meta.get('message')}")
            elif msg.type is MsgType.ERROR and self._on_device(replica, pending):
                # It declared the GPU but cannot read the handle: host arrays from now on.
                replica.cuda_failed = True
                log.warning(
                    "inference server %s refused a CUDA IPC handle (%s); sending it host arrays",
                    replica.address,
                    msg.meta.get("message"),
                )
                self._retry(pending, "CUDA IPC refused")
            else:
                self._fail(pending, f"{replica.address}: [{msg.meta.get('code')}] {msg.meta.get('message')}")

    @staticmethod
    def _on_device(replica: Replica, pending: Pending) -> bool:
        """Whether ``pending`` goes to ``replica`` as its CUDA IPC handle."""
        return (
            pending.device_obs is not None
            and not replica.cuda_failed
            and same_device(replica.cuda, pending.device_obs)
        )

    def _retry(self, pending: Pending, why: str) -> None:
        if time.monotonic() >= pending.deadline:
            self._fail(pending, f"gateway deadline passed ({why})")
            return
        self.counters["retried"] += 1
        log.debug("retrying request %s: %s", pending.key, why)
        self._dispatch(pending)

    def _fail(self, pending: Pending, why: str) -> None:
        self.counters["failed"] += 1
        self._done.append((pending.key, None, None, why))

    def _mark_down(self, replica: Replica, why: str) -> None:
        if replica.up:
            replica.downs += 1
            log.warning(
                "inference server %s is down (%s); retrying its %d request(s) elsewhere",
                replica.address,
                why,
                len(replica.inflight),
            )
        replica.up = False
        inflight, replica.inflight, replica.rows = replica.inflight, {}, 0
        for pending, _, _ in inflight.values():
            self._retry(pending, f"{replica.address} went down")

    def _flush_waiting(self) -> None:
        waiting, self.waiting = self.waiting, []
        for pending in waiting:
            self._dispatch(pending)

    def _check(self, now: float) -> None:
        """Liveness of servers owing answers, attempts past their deadline, expired waiters."""
        for replica in self.replicas:
            if not replica.inflight:
                continue
            if replica.up and now - replica.last_heard > self.replica_timeout_s:
                self._mark_down(replica, f"silent for {now - replica.last_heard:.1f} s")
                continue
            # The server answers an expired request with deadline_exceeded; past a
            # grace period it will not answer at all.
            grace = self.replica_timeout_s
            for seq, (pending, attempt_deadline, _) in list(replica.inflight.items()):
                if now > attempt_deadline + grace:
                    del replica.inflight[seq]
                    replica.rows -= pending.rows
                    self._retry(pending, f"no answer from {replica.address}")
        if self.waiting:
            still = []
            for pending in self.waiting:
                if now >= pending.deadline:
                    self._fail(pending, "no inference server is up")
                else:
                    still.append(pending)
            self.waiting = still
            if still and self._current():
                self._flush_waiting()
