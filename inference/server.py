"""The inference server process: batched policy serving with hot-swapped weights.

Three ROUTER sockets (addresses in ``endpoints.json`` under ``inference[i]``):

- ``requests``: INFER ``{deadline_ms, deterministic?}`` with ``obs/<key>`` arrays
  ``[B, ...]``, or instead ``meta["cuda_ipc"]``, a handle of them on this server's GPU
  (:mod:`gateway.cuda_ipc`, torch on CUDA; the server declares its GPU in every HEARTBEAT
  and METADATA answer) (and optionally ``deterministic bool[B]``: rows that must act
  deterministically, e.g. evaluation episodes) -> ACTION ``{version, batch_rows, queue_us}`` with ``action [B, ...]``
  and ``policy_version i64[B]``, or ERROR (``bad_request``: observations that do not
  fit the spec; ``deadline_exceeded``; ``unavailable``: queue full). HEARTBEAT ->
  HEARTBEAT ``{version, queue_rows}``.
- ``weights``: WEIGHTS buckets -> WEIGHTS_ACK or ERROR (:mod:`inference.weights`);
  COMMAND ``rollback``.
- ``control``: METADATA -> REPLY (spec, backend, providers, device, version, queue
  depth, counters); COMMAND ``status`` | ``rollback`` | ``shutdown``.

Two threads. The socket thread receives and validates requests, and when a batch is
due runs it and answers straight away (:mod:`inference.batcher`); requests
arriving meanwhile queue in ZeroMQ and form the next batch. The loader thread
assembles, validates and builds new versions, so a publication never holds up
serving; its answers reach the socket thread over an ``inproc`` socket without copies.
Counters and latency histograms go to ``<run>/metrics.jsonl`` as ``inference-<i>``::

    python -m inference --config configs/reach_sim.yaml --run-dir runs/inf --index 0

The process around it (config, addresses, signals, priority) is :mod:`inference.__main__`.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from gateway import cuda_ipc
from gateway.config import to_plain
from gateway.episode import EnvSpec
from gateway.gpu_stats import for_device
from gateway.metrics import MetricsWriter
from gateway.priority import leave_realtime, step_below, threads_named
from gateway.protocol import (
    ErrorCode,
    Limits,
    Message,
    MsgType,
    ProtocolError,
    encode,
    error_message,
    recv_frames,
    recv_routed,
    send,
    send_frames,
    unpack,
)
from gateway.protocol.schemas import INFERENCE_REQUEST
from gateway.transport import CurveKeys, bind, inproc_address, make_socket, readable, wait_readable
from inference.backends import Backend, LoadedPolicy, make_backend
from inference.batcher import Batcher, Request, Staged, Stats
from inference.config import InferenceConfig
from inference.weights import WeightsAssembler, WeightsError

log = logging.getLogger(__name__)

SOCKETS = ("requests", "weights", "control")
TAGS = {name: name[0].encode() for name in SOCKETS}
SWITCH_INTERVAL_S = 0.0002
WEIGHTS_THREADS = 7
"""``THREAD_NAME_PREFIX`` of the weights socket's own ZeroMQ context: its threads are named
``7/ZMQbg/...`` (libzmq takes a number), told apart from the serving context's."""


def weights_threads(timeout_s: float = 2.0) -> list[int]:
    """Thread ids of the weights context's two threads (its I/O thread and its reaper).
    libzmq starts them with the context's first socket and each names itself once
    running: wait until both are named, for at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while len(found := threads_named(f"{WEIGHTS_THREADS}/ZMQbg")) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    if len(found) < 2:
        log.warning("the weights context's threads: %d of 2 named after %.1f s", len(found), timeout_s)
    return found


WAKE = b"w"
"""A one-frame message on the ``inproc`` socket: the loader staged a version."""
SWAP_WAIT_S = 1.0
"""Longest the loader waits for a staged version to be swapped in before it prepares the next."""
MAX_QUEUE_BATCHES = 64
"""Queued rows beyond ``max_batch * this`` are refused with ``unavailable`` (backpressure)."""


class InferenceServer:
    """One replica; construct (binds), then :meth:`serve` until stopped, then :meth:`close`."""

    def __init__(
        self,
        *,
        config: InferenceConfig,
        spec: EnvSpec,
        addresses: dict[str, str],
        index: int = 0,
        keys: CurveKeys | None = None,
        metrics: MetricsWriter | None = None,
        realtime_priority: int = 0,
        limits: Limits | None = None,
        backend: Backend | None = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.config, self.spec, self.index = config, spec, index
        self.realtime_priority = realtime_priority
        """``run.realtime_priority``: every thread's, taken when :func:`main` starts serving."""
        self.limits = limits or Limits()
        self.metrics = metrics or MetricsWriter(None, f"inference-{index}")
        self.backend = backend or make_backend(spec, config)
        device = str(self.backend.describe().get("device", "cpu"))
        self.gpu = for_device(device)
        self.max_wait_us = config.max_wait_on(device)
        self.device = cuda_ipc.DeviceReader.for_device(
            config.cuda_ipc, self.backend.tensor_device(), self.limits
        )
        """Reads CUDA IPC handles of observations and weights on this server's GPU (None: none)."""
        policy = self.backend.initial()
        self.stats = Stats()
        self.batcher = Batcher(
            policy,
            action_shape=tuple(spec.action.shape),
            action_dtype=spec.action.dtype,
            max_batch=config.max_batch,
            max_wait_us=self.max_wait_us,
            max_queue_rows=config.max_batch * MAX_QUEUE_BATCHES,
            seed=config.seed + index,
            reply=self.reply,
            stats=self.stats,
            retire=self._retire,
            concat=self.backend.concat,
        )
        self._ctx = context or zmq.Context.instance()
        # Weights arrive through a context of their own, whose I/O thread runs below the
        # serving threads (weights_below_serving): tens of megabytes read at their priority
        # kept requests waiting while the transfer lasted.
        self._weights_ctx: zmq.Context[Any] = zmq.Context(io_threads=1)
        self._weights_ctx.set(zmq.THREAD_NAME_PREFIX, WEIGHTS_THREADS)
        self.socks: dict[str, zmq.Socket[Any]] = {}
        self.addresses: dict[str, str] = {}
        for name in SOCKETS:
            ctx = self._weights_ctx if name == "weights" else self._ctx
            sock = make_socket(ctx, zmq.ROUTER, sndhwm=10_000, rcvhwm=10_000)
            sock.router_mandatory = False
            self.addresses[name] = bind(sock, addresses[name], keys)
            self.socks[name] = sock
        self._by_tag = {TAGS[n]: s for n, s in self.socks.items()}
        self._inproc = inproc_address("inference-replies")
        self._pull = make_socket(self._ctx, zmq.PULL, rcvhwm=0)
        self._pull.bind(self._inproc)
        self._local = threading.local()
        self._socket_thread = threading.get_ident()
        self._pushes: list[zmq.Socket[Any]] = []
        self._push_lock = threading.Lock()
        self.assembler = WeightsAssembler()
        self.loads: queue.Queue[tuple[bytes, Message] | None] = queue.Queue()
        """WEIGHTS buckets for the loader thread, which assembles, checks and loads them."""
        self._logged: set[tuple[bytes, str]] = set()
        self.stopping = threading.Event()
        self.failure: BaseException | None = None
        self.started = time.monotonic()
        log.info(
            "inference-%d serving version %d on %s with %s",
            index,
            policy.version,
            json.dumps(self.addresses),
            json.dumps(self.backend.describe()),
        )

    # ----------------------------------------------------------------- answers

    def reply(self, tag: bytes, route: bytes, msg: Message) -> None:
        """Answer from any thread: sent at once on the socket thread, queued for it elsewhere."""
        if threading.get_ident() == self._socket_thread:
            send_frames(self._by_tag[tag], [route, *encode(msg)])
            return
        self._push([tag, route, *encode(msg)])

    def _wake(self) -> None:
        """Make the socket thread look at the batcher (a version was staged)."""
        self._push([WAKE])

    def _push(self, frames: list[Any]) -> None:
        push = getattr(self._local, "push", None)
        if push is None:
            push = make_socket(self._ctx, zmq.PUSH, sndhwm=0)
            push.connect(self._inproc)
            with self._push_lock:
                self._pushes.append(push)
            self._local.push = push
        send_frames(push, frames)

    def _forward(self) -> None:
        for _ in range(1000):
            try:
                tag, *rest = recv_frames(self._pull, zmq.NOBLOCK)
            except zmq.Again:
                return
            if rest:  # else a wake-up: the loop applies staged versions after this
                route, *frames = rest
                send_frames(self._by_tag[tag.bytes], [route, *frames])

    def _error(self, name: str, route: bytes, exc: ProtocolError, seq: int = 0) -> None:
        self.stats.error(exc.code.value)
        if (route, exc.code.value) not in self._logged:
            self._logged.add((route, exc.code.value))
            log.warning("peer %s on %s: %s (further ones are counted)", route.hex()[:8], name, exc)
        send(self.socks[name], error_message(exc.code.value, exc.message, seq), route=[route])

    # ---------------------------------------------------------------- messages

    def _on_message(self, name: str) -> None:
        sock = self.socks[name]
        route, msg, err = recv_routed(sock, self.limits, zmq.NOBLOCK)
        if err is not None:
            self._error(name, route, err)
            return
        assert msg is not None
        try:
            if msg.type is MsgType.INFER and name == "requests":
                self._on_request(route, msg)
            elif msg.type is MsgType.HEARTBEAT:
                _, rows = self.batcher.depth()
                meta: dict[str, Any] = {
                    "version": self.batcher.version,
                    "queue_rows": rows,
                    "index": self.index,
                }
                if self.device is not None:
                    meta["cuda_ipc"] = self.device.declaration()
                send(sock, Message(MsgType.HEARTBEAT, seq=msg.seq, meta=meta), route=[route])
            elif msg.type is MsgType.METADATA:
                send(sock, Message(MsgType.REPLY, seq=msg.seq, meta=self.describe()), route=[route])
            elif msg.type is MsgType.COMMAND:
                self._on_command(name, route, msg)
            elif msg.type is MsgType.WEIGHTS and name == "weights":
                self._on_weights(route, msg)
            else:
                raise ProtocolError(
                    ErrorCode.UNEXPECTED, f"{msg.type.name} is not accepted on the {name} socket"
                )
        except ProtocolError as exc:
            self._error(name, route, exc, msg.seq)

    def _on_request(self, route: bytes, msg: Message) -> None:
        now = time.monotonic()
        problems = INFERENCE_REQUEST.problems(msg)
        if problems:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "inference request: " + "; ".join(problems))
        obs: dict[str, Any]
        if "cuda_ipc" in msg.meta:
            obs, rows, problems = self._device_obs(msg)
        else:
            obs = unpack("obs", msg.arrays)
            rows = len(next(iter(obs.values()))) if obs and next(iter(obs.values())).ndim else 0
            problems = self.spec.check_observation(obs, rows) if rows else ["no observation rows"]
        if problems:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, "observations do not fit the spec: " + "; ".join(problems)
            )
        deadline_ms = msg.meta.get("deadline_ms", self.config.deadline_ms)
        if not isinstance(deadline_ms, (int, float)) or isinstance(deadline_ms, bool) or not deadline_ms > 0:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"deadline_ms must be a positive number, got {deadline_ms!r}"
            )
        deterministic: Any = msg.meta.get("deterministic", self.config.deterministic)
        flags = msg.arrays.get("deterministic")
        if flags is not None:
            if flags.dtype != bool or flags.shape != (rows,):
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST,
                    f"'deterministic' must be bool[{rows}], got {flags.dtype}{list(flags.shape)}",
                )
            deterministic = flags | bool(deterministic)
        else:
            deterministic = bool(deterministic)
        request = Request(
            tag=TAGS["requests"],
            route=route,
            seq=msg.seq,
            obs=obs,
            rows=rows,
            t_recv=now,
            deadline=now + float(deadline_ms) / 1e3,
            deterministic=deterministic,
        )
        self.stats.count(received=1)
        if not self.batcher.put(request):
            raise ProtocolError(ErrorCode.UNAVAILABLE, "the request queue is full; try another server")

    def _device_obs(self, msg: Message) -> tuple[dict[str, Any], int, list[str]]:
        """The observations a request's CUDA IPC handle names, read in place on this GPU:
        (tensors, rows, problems against the spec)."""
        if self.device is None:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                "this server takes no CUDA IPC handles (not torch on a GPU, or inference.cuda_ipc: off); "
                "send obs/* arrays",
            )
        if any(k.startswith("obs/") for k in msg.arrays):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, "a request carries obs/* arrays or a CUDA IPC handle, not both"
            )
        handle = self.device.check(msg.meta["cuda_ipc"])
        layout = handle.layout()
        leading = {shape[0] if shape else 0 for _, shape in layout.values()}
        rows = leading.pop() if len(leading) == 1 else 0
        if not rows:
            return {}, 0, [f"CUDA IPC arrays must share one leading dimension >= 1, got {sorted(leading)}"]
        problems = []
        for key, a in self.spec.observation.items():
            want = (a.np_dtype.name, (rows, *a.shape))
            got = layout.get(key)
            if got != want:
                have = "missing" if got is None else f"{got[0]}{list(got[1])}"
                problems.append(f"observation {key!r} is {have}, expected {want[0]}{list(want[1])}")
        extra = sorted(set(layout) - set(self.spec.observation))
        if extra:
            problems.append(f"unexpected observation keys {extra}")
        if problems:
            return {}, rows, problems
        tensors = self.device.open(handle)
        self.stats.count(device_requests=1, device_bytes=handle.nbytes)
        return tensors, rows, []

    def _on_command(self, name: str, route: bytes, msg: Message) -> None:
        cmd = msg.meta.get("cmd")
        if cmd == "rollback" and name in ("weights", "control"):
            self.batcher.request_rollback(TAGS[name], route, msg.seq)
            return
        if cmd == "status":
            result = self.describe()
        elif cmd == "shutdown" and name == "control":
            self.stopping.set()
            result = {"stopping": True}
        else:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"unknown command {cmd!r} here (status, rollback, shutdown)"
            )
        send(self.socks[name], Message(MsgType.REPLY, seq=msg.seq, meta=result), route=[route])

    def _on_weights(self, route: bytes, msg: Message) -> None:
        # Reassembling and checking a 32 MB bucket takes tens of milliseconds: on this
        # thread it would hold up every request behind it, so the loader does it.
        self.loads.put((route, msg))

    def _retire(self, policy: LoadedPolicy) -> None:
        """``policy`` will never run again (see ``Batcher.retire``): recycle its buffers."""
        if policy.received is not None:
            self.assembler.pool.give(policy.received.values())
            policy.received = None

    # ------------------------------------------------------------------ loader

    def _refuse(self, route: bytes, exc: WeightsError, seq: int) -> None:
        self.stats.count(weights_refused=1)
        self.stats.error(exc.code.value)
        log.warning("refused weights from %s: %s", route.hex()[:8], exc)
        self.reply(TAGS["weights"], route, error_message(exc.code.value, exc.message, seq))

    def weights_below_serving(self) -> bool:
        """The weights context's threads (its I/O thread reads every transfer) one real-time
        priority below the serving threads (:func:`gateway.priority.step_below`): a request
        preempts a transfer, which still preempts normal-priority processes (a trainer
        publishing from this host). At normal priority, like the loader, an idle server's
        publication took 10-20 % longer. Called once the process went real-time
        (:func:`gateway.priority.go_realtime`)."""
        return step_below("the weights socket's I/O", weights_threads())

    def _load_loop(self) -> None:
        # Below the socket thread and ZeroMQ's I/O thread, and off real-time scheduling:
        # building a version is long, CPU-bound work; at their priority it would hold
        # answers up until it blocks, and at any real-time priority its time would push
        # a busy core past the kernel's real-time budget (then ~50 ms of no answers).
        leave_realtime("the weights loader")
        self.backend.prepare()
        while not self.stopping.is_set():
            try:
                item = self.loads.get(timeout=0.5)
            except queue.Empty:
                continue
            if item is None:
                return
            route, msg = item
            try:
                update = self.assembler.add(route, msg, self.batcher.newest)
            except WeightsError as exc:
                self._refuse(route, exc, msg.seq)
                continue
            if update is None:
                continue  # more buckets to come
            self.stats.count(weights_received=1)
            t0 = time.monotonic()
            try:
                if update.version <= self.batcher.newest:
                    raise WeightsError(
                        ErrorCode.STALE_VERSION,
                        f"version {update.version} is not newer than version {self.batcher.newest} (serving or loading)",
                    )
                if update.format == "onnx":
                    policy = self.backend.from_onnx(update.arrays["onnx"], update.version)
                elif update.device is not None:
                    policy = self.backend.from_state_dict(self._device_weights(update.device), update.version)
                else:
                    policy = self.backend.from_state_dict(
                        update.arrays, update.version, finite_checked=update.finite_checked
                    )
            except WeightsError as exc:
                self.assembler.pool.give(update.arrays.values())  # nothing will run them
                self._refuse(update.route, exc, update.seq)
                continue
            policy.received = update.arrays
            log.debug(
                "version %d loaded in %.1f ms; swapping it in", update.version, (time.monotonic() - t0) * 1e3
            )
            self.batcher.stage(Staged(policy, TAGS["weights"], update.route, update.seq, t0))
            self._wake()
            # The next version's module structure is built once this one is answered:
            # built meanwhile, its Python would share the GIL with the swap and the answer
            # the publisher waits for. A serving thread stuck in a long batch delays it no
            # more than SWAP_WAIT_S.
            if not self.batcher.taken.wait(SWAP_WAIT_S):
                log.debug(
                    "version %d not swapped in within %.1f s; preparing the next anyway",
                    update.version,
                    SWAP_WAIT_S,
                )
            self.backend.prepare()

    def _device_weights(self, handle: cuda_ipc.DeviceHandle) -> dict[str, Any]:
        """Copies (device to device, complete) of a CUDA IPC publication's tensors."""
        if self.device is None:
            raise WeightsError(
                ErrorCode.BAD_WEIGHTS,
                "this server takes no CUDA IPC weights (not torch on a GPU, or inference.cuda_ipc: off); "
                "publish host arrays",
            )
        try:
            self.device.accepts(handle)
            return self.device.copy_out(handle)
        except ProtocolError as exc:
            raise WeightsError(ErrorCode.BAD_WEIGHTS, exc.message) from None

    # --------------------------------------------------------------------- run

    def describe(self) -> dict[str, Any]:
        requests, rows = self.batcher.depth()
        previous = self.batcher.previous
        return {
            "index": self.index,
            **self.backend.describe(),
            "version": self.batcher.version,
            "previous_version": previous.version if previous is not None else None,
            "queue_requests": requests,
            "queue_rows": rows,
            "max_batch": self.config.max_batch,
            "max_wait_us": self.max_wait_us,
            "deadline_ms": self.config.deadline_ms,
            "deterministic": self.config.deterministic,
            "cuda_ipc": self.device.declaration() if self.device is not None else None,
            "network": to_plain(self.config.network),
            "spec": self.spec.to_dict(),
            "addresses": dict(self.addresses),
            "uptime_s": round(time.monotonic() - self.started, 1),
            "stats": self.stats.snapshot(),
        }

    def _guarded(self, target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as exc:  # a bug: stop the process loudly, the supervisor restarts it
                log.exception("the %s thread failed", threading.current_thread().name)
                self.failure = exc
                self.stopping.set()

        return run

    def serve(self, stop: threading.Event | None = None) -> None:
        self._socket_thread = threading.get_ident()
        loader = threading.Thread(target=self._guarded(self._load_loop), name="loader", daemon=True)
        loader.start()
        poller = zmq.Poller()
        watched = [self._pull, *self.socks.values()]
        for sock in watched:
            poller.register(sock, zmq.POLLIN)
        batcher = self.batcher
        next_metrics = time.monotonic()
        try:
            while not self.stopping.is_set() and not (stop is not None and stop.is_set()):
                wait = batcher.due(time.monotonic())
                # Poll at least until the next batch is due; a request arriving ends it sooner.
                if wait is not None and 0 < wait < 1e-3:  # zmq.poll would round it up to 1 ms
                    events = dict(poller.poll(0)) if wait_readable(watched, wait) else {}
                else:
                    events = dict(poller.poll(100 if wait is None else math.ceil(wait * 1e3)))
                if self._pull in events:
                    self._forward()
                for name, sock in self.socks.items():
                    if sock in events:
                        for _ in range(256):
                            self._on_message(name)
                            if not readable(sock):
                                break
                batcher.apply_changes()
                if batcher.due(time.monotonic()) == 0:
                    batcher.serve(batcher.take_batch())
                now = time.monotonic()
                if now >= next_metrics:
                    self.emit_metrics()
                    next_metrics = now + self.config.metrics_interval_s
        finally:
            self.loads.put(None)
            loader.join(timeout=5.0)
            self._forward()
            self.emit_metrics()

    def emit_metrics(self) -> None:
        requests, rows = self.batcher.depth()
        self.metrics.emit(
            {
                "version": self.batcher.version,
                "queue_requests": requests,
                "queue_rows": rows,
                **self.stats.snapshot(),
                **({"gpu": self.gpu.snapshot()} if self.gpu is not None else {}),
            }
        )

    def close(self) -> None:
        with self._push_lock:
            for push in self._pushes:
                push.close(linger=0)
        for sock in (*self.socks.values(), self._pull):
            sock.close(linger=0)
        self._weights_ctx.term()
        self.metrics.close()
        if self.gpu is not None:
            self.gpu.close()
