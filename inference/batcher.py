"""Dynamic batching and weight swaps, driven by the server's socket thread.

The socket thread :meth:`~Batcher.put` s validated requests as they arrive. A batch is
:meth:`~Batcher.due` once ``max_batch`` rows are queued, the oldest request has waited
``max_wait_us``, or no request is on its way (:class:`Arrivals`); then the socket
thread takes it (:meth:`~Batcher.take_batch`), runs one forward pass over it
(:meth:`~Batcher.serve`) and hands each request its rows through ``reply``. Requests
that arrive meanwhile wait in ZeroMQ's queue and make up the next batch. Serving on
the thread that receives costs no hand-over between threads per batch and no hop per
answer: with the interpreter lock, those cost more than the batch itself on a CPU. A
request whose deadline passed before or during its batch gets ``deadline_exceeded``
instead of a late action.

Weight changes happen between two batches: a version the loader thread built
(:meth:`~Batcher.stage`) or a rollback (:meth:`~Batcher.request_rollback`) is a
pointer swap when :meth:`~Batcher.apply_changes` runs, so no request waits for a load;
the loader never blocks serving.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np

from gateway.log_every import LogEvery
from gateway.metrics import Histogram
from gateway.protocol import ErrorCode, Message, MsgType, error_message
from gateway.steps import filled
from inference.backends import LoadedPolicy

log = logging.getLogger(__name__)

SWAP_LOG_S = 30.0
"""A swap is logged at most once in this long; the swaps between are counted in that line."""

Reply = Callable[[bytes, bytes, Message], None]
"""``reply(socket tag, route, message)``: queue an answer for the socket thread."""


@dataclass
class Request:
    """One gateway request: a batch of observations with a deadline."""

    tag: bytes
    route: bytes
    seq: int
    obs: dict[str, Any]
    """Arrays ``[rows, ...]``, or tensors on the backend's device (CUDA IPC)."""
    rows: int
    t_recv: float
    deadline: float
    deterministic: bool | np.ndarray
    """One mode for every row, or ``bool[rows]`` (True: the deterministic action)."""


@dataclass
class Staged:
    """A version built by the loader, waiting for the next batch boundary."""

    policy: LoadedPolicy
    tag: bytes
    route: bytes
    seq: int
    t_start: float


class Stats:
    """Counters and histograms shared by the server's threads (under one lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.batch_rows = Histogram()
        self.latency_us = Histogram()
        self.infer_us = Histogram()
        self.swap_ms = Histogram()

    def count(self, **inc: int) -> None:
        with self.lock:
            counters = self.counters
            for name, n in inc.items():  # Counter.update's Mapping checks cost more, once a request
                counters[name] += n

    def error(self, code: str) -> None:
        with self.lock:
            self.errors[code] += 1

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {
                **dict(self.counters),
                "errors": dict(self.errors),
                "batch_rows": self.batch_rows.summary(),
                "latency_p50_us": round(self.latency_us.percentile(50), 1),
                "latency_p99_us": round(self.latency_us.percentile(99), 1),
                "infer_p50_us": round(self.infer_us.percentile(50), 1),
                "infer_p99_us": round(self.infer_us.percentile(99), 1),
                "swap_ms": self.swap_ms.summary(),
                # Whole histograms, so that replicas' figures merge exactly.
                "latency_us": self.latency_us.to_dict(),
                "infer_us": self.infer_us.to_dict(),
            }


class Arrivals:
    """Which peers send requests and how many each keeps in flight: whether waiting can help.

    Gateways are closed loops: a worker's next observation comes only after its action,
    so a peer keeps a steady number of requests in flight (one per worker it serves).
    When every recently active peer has that many queued, no request is on its way and
    a batch leaves at once instead of waiting out ``max_wait_us`` (a lone client would
    otherwise pay the whole wait on every request). Used under the batcher's lock.
    """

    WINDOW_S = 1.0
    """A peer silent this long no longer counts; its in-flight peak is forgotten as slowly."""

    def __init__(self) -> None:
        # route -> [in flight, peak this window, peak last window, last request, window start]
        self.peers: dict[bytes, list[float]] = {}

    def arrived(self, route: bytes, now: float) -> None:
        peer = self.peers.get(route)
        if peer is None:
            peer = self.peers[route] = [0, 0, 0, now, now]
        peer[0] += 1
        peer[1] = max(peer[1], peer[0])
        peer[3] = now

    def answered(self, route: bytes) -> None:
        peer = self.peers.get(route)
        if peer is not None:
            peer[0] = max(0, peer[0] - 1)

    def expected(self, now: float) -> int:
        """Requests recently active peers usually have in flight and have not sent yet."""
        missing = 0
        for route, peer in list(self.peers.items()):
            inflight, peak, previous, last, since = peer
            if now - since > self.WINDOW_S:
                peer[1], peer[2], peer[4] = inflight, peak, now
            if now - last > self.WINDOW_S:
                if inflight == 0 and now - last > 2 * self.WINDOW_S:
                    del self.peers[route]
                continue
            missing += int(max(0, max(peak, previous) - inflight))
        return missing


class Batcher:
    """The request queue, the serving version and one batch at a time.

    Everything but :meth:`stage` runs on the socket thread; :meth:`stage` (the loader
    thread) and :meth:`apply_changes` share the staged version under ``lock``.
    """

    def __init__(
        self,
        policy: LoadedPolicy,
        *,
        action_shape: tuple[int, ...],
        action_dtype: str = "float32",
        max_batch: int,
        max_wait_us: int,
        max_queue_rows: int,
        seed: int,
        reply: Reply,
        stats: Stats,
        retire: Callable[[LoadedPolicy], None] | None = None,
        concat: Callable[[list[Any]], Any] = np.concatenate,
    ) -> None:
        self.current = policy
        self.concat = concat
        """Joins one key's rows of several requests (numpy, or the backend's tensors)."""
        self.retire = retire
        """Called with a version that can never serve again: retired by a swap or a rollback
        (between batches), or superseded before it served (by ``stage``)."""
        self.previous: LoadedPolicy | None = None
        self.action_shape, self.action_dtype = action_shape, np.dtype(action_dtype)
        self.max_batch, self.max_wait_s = max_batch, max_wait_us / 1e6
        self.max_queue_rows = max_queue_rows
        self.reply, self.stats = reply, stats
        self.rng = np.random.default_rng(seed)
        self.lock = threading.Lock()
        self.queue: deque[Request] = deque()
        self.queued_rows = 0
        self.arrivals = Arrivals()
        self.staged: Staged | None = None
        self.taken = threading.Event()
        """Set once the last staged version was swapped in (or refused) and answered."""
        self.newest = policy.version
        """Newest version serving or staged; a publication must be newer (reset by a rollback)."""
        self.rollback: tuple[bytes, bytes, int] | None = None
        self._swap_log = LogEvery(SWAP_LOG_S)

    @property
    def version(self) -> int:
        return self.current.version

    # ------------------------------------------------------------------ queue

    def put(self, request: Request) -> bool:
        """Queue a request; ``False`` when the queue is full (the caller answers ``unavailable``)."""
        if self.queued_rows + request.rows > self.max_queue_rows and self.queue:
            return False
        self.queue.append(request)
        self.queued_rows += request.rows
        self.arrivals.arrived(request.route, request.t_recv)
        return True

    def depth(self) -> tuple[int, int]:
        """(queued requests, queued rows)."""
        return len(self.queue), self.queued_rows

    def due(self, now: float) -> float | None:
        """Seconds until the next batch should leave (0: now); None with nothing queued.

        A young batch waits for more rows until ``max_batch``, the oldest request's
        ``max_wait_us``, or until no request is to be expected (:class:`Arrivals`).
        """
        if not self.queue:
            return None
        remaining = self.queue[0].t_recv + self.max_wait_s - now
        if self.queued_rows >= self.max_batch or remaining <= 0 or not self.arrivals.expected(now):
            return 0.0
        return remaining

    def take_batch(self) -> list[Request]:
        """The oldest requests, up to ``max_batch`` rows (at least one request)."""
        batch: list[Request] = []
        rows = 0
        while self.queue and (not batch or rows + self.queue[0].rows <= self.max_batch):
            request = self.queue.popleft()
            self.queued_rows -= request.rows
            # Counted as answered now: its peer's next request follows the answer.
            self.arrivals.answered(request.route)
            batch.append(request)
            rows += request.rows
        return batch

    # --------------------------------------------------------------- versions

    def stage(self, staged: Staged) -> None:
        """Swap ``staged`` in before the next batch (a newer one replaces an older one)."""
        with self.lock:
            old, self.staged = self.staged, staged
            self.newest = max(self.newest, staged.policy.version)
            self.taken.clear()
        if old is not None:
            if self.retire is not None:
                self.retire(old.policy)  # it never served
            self.reply(
                old.tag,
                old.route,
                error_message(
                    ErrorCode.STALE_VERSION.value,
                    f"version {old.policy.version} was superseded by {staged.policy.version} before it served",
                    old.seq,
                ),
            )

    def request_rollback(self, tag: bytes, route: bytes, seq: int) -> None:
        self.rollback = (tag, route, seq)

    def apply_changes(self) -> None:
        """Swap in staged weights or roll back, between two batches, and answer who asked."""
        with self.lock:
            staged, self.staged = self.staged, None
        if staged is not None:
            self._swap(staged)
            self.taken.set()
        if self.rollback is not None:
            (tag, route, seq), self.rollback = self.rollback, None
            self._roll_back(tag, route, seq)

    def _swap(self, staged: Staged) -> None:
        if staged.policy.version <= self.current.version:
            if self.retire is not None:
                self.retire(staged.policy)
            msg = error_message(
                ErrorCode.STALE_VERSION.value,
                f"version {staged.policy.version} is not newer than the version serving ({self.current.version})",
                staged.seq,
            )
        else:
            retired, self.previous, self.current = self.previous, self.current, staged.policy
            if retired is not None and self.retire is not None:
                self.retire(retired)
            swap_ms = (time.monotonic() - staged.t_start) * 1e3
            with self.stats.lock:
                self.stats.counters["swaps"] += 1
                self.stats.swap_ms.add(swap_ms)
            self._log_swap(self.current.version, self.previous.version)
            meta = {"version": self.current.version, "previous": self.previous.version, "swap_ms": swap_ms}
            msg = Message(MsgType.WEIGHTS_ACK, seq=staged.seq, meta=meta)
        self.reply(staged.tag, staged.route, msg)

    def _log_swap(self, version: int, previous: int) -> None:
        """The version now serving, at most once in :data:`SWAP_LOG_S` (the others counted):
        a trainer publishing every few dozen updates swaps several times a second."""
        held = self._swap_log.passes()
        if held is None:
            return
        more = f"; {held} more swap(s) since the last such line" if held else ""
        log.info("now serving version %d (previous %d%s)", version, previous, more)

    def _roll_back(self, tag: bytes, route: bytes, seq: int) -> None:
        if self.previous is None:
            msg = error_message(ErrorCode.UNAVAILABLE.value, "no previous version to roll back to", seq)
        else:
            retired, self.current, self.previous = self.current, self.previous, None
            if self.retire is not None:
                self.retire(retired)
            with self.lock:
                self.newest = self.current.version
            self.stats.count(rollbacks=1)
            log.warning("rolled back from version %d to %d", retired.version, self.current.version)
            msg = Message(
                MsgType.REPLY,
                seq=seq,
                meta={"version": self.current.version, "rolled_back_from": retired.version},
            )
        self.reply(tag, route, msg)

    # ------------------------------------------------------------------ serve

    def _expire(self, request: Request, now: float, when: str) -> None:
        late_ms = (now - request.deadline) * 1e3
        self.stats.error(ErrorCode.DEADLINE_EXCEEDED.value)
        self.reply(
            request.tag,
            request.route,
            error_message(
                ErrorCode.DEADLINE_EXCEEDED.value,
                f"request {request.seq} passed its deadline {when} ({late_ms:.1f} ms late)",
                request.seq,
            ),
        )

    def serve(self, batch: list[Request]) -> None:
        """One forward pass over ``batch``; every request gets its rows or a typed error."""
        now = time.monotonic()
        live = []
        for request in batch:
            if now >= request.deadline:
                self._expire(request, now, "in the queue")
            else:
                live.append(request)
        if not live:
            return
        policy = self.current
        obs = {
            key: (live[0].obs[key] if len(live) == 1 else self.concat([r.obs[key] for r in live]))
            for key in live[0].obs
        }
        ends = list(accumulate(r.rows for r in live))
        spans = list(zip([0, *ends[:-1]], ends))  # each request's rows in the batch
        rows = ends[-1]
        # One draw for the batch; deterministic rows (whole requests or flagged rows) get 0.
        eps = self.rng.standard_normal((rows, *self.action_shape), dtype=np.float32)
        for request, (start, end) in zip(live, spans):
            mode = request.deterministic
            if isinstance(mode, np.ndarray):
                eps[start:end][mode] = 0.0
            elif mode:
                eps[start:end] = 0.0
        t0 = time.monotonic()
        actions = np.ascontiguousarray(policy.run(obs, eps), dtype=self.action_dtype)
        done = time.monotonic()
        finite = np.isfinite(actions).reshape(rows, -1).all(axis=1)  # per row
        all_finite = np.count_nonzero(finite) == rows  # else each request checks its own rows
        versions = filled(rows, policy.version, np.int64)
        answered: list[float] = []
        for request, (start, end) in zip(live, spans):
            if done >= request.deadline:
                self._expire(request, done, "while its batch ran")
                continue
            if not all_finite and np.count_nonzero(finite[start:end]) != end - start:
                self.stats.error(ErrorCode.BAD_REQUEST.value)
                self.reply(
                    request.tag,
                    request.route,
                    error_message(
                        ErrorCode.BAD_REQUEST.value,
                        "the policy gave non-finite actions for these observations (NaN or Inf in them?)",
                        request.seq,
                    ),
                )
                continue
            meta = {
                "version": policy.version,
                "batch_rows": rows,
                "queue_us": round((t0 - request.t_recv) * 1e6, 1),
            }
            arrays = {"action": actions[start:end], "policy_version": versions[start:end]}
            self.reply(
                request.tag, request.route, Message(MsgType.ACTION, seq=request.seq, meta=meta, arrays=arrays)
            )
            answered.append(time.monotonic() - request.t_recv)
        with self.stats.lock:
            counters = self.stats.counters
            counters["batches"] += 1
            counters["rows"] += rows
            counters["requests"] += len(live)
            self.stats.batch_rows.add(rows)
            self.stats.infer_us.add((done - t0) * 1e6)
            for latency in answered:
                self.stats.latency_us.add(latency * 1e6)
