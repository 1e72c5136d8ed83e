"""The client and server processes of the round-trip benchmark (:mod:`benchmarks.gateway_rtt`).

Five roles, each ``python -m benchmarks.rtt_peers ROLE ...``:

- ``worker``: the product's own :class:`gateway.worker.EnvWorker` hosting one
  :class:`~benchmarks.payload.PayloadBackend` env, connected to a real gateway
  process; it records the worker's round trip of every step (OBSERVATION sent ->
  ACTION received and decoded, the span the worker reports as ``rtt_us``) and the
  period of its loop (one env step to the next: everything the worker does per step);
- ``zmq-server`` / ``zmq-client``: the baseline, raw pyzmq DEALER -> ROUTER on the same
  transport: the client sends the same payload as one frame (from a fresh array, as
  the backend makes) and waits for a reply the size of one action; no protocol, no
  recording;
- ``unix-server`` / ``unix-client``: a reference without ZeroMQ's I/O threads: the same
  payload and reply over a unix socket with :mod:`multiprocessing.connection` (what a
  ``multiprocessing.Pipe``, and so gymnasium's AsyncVectorEnv, sends through).

The clients write ``rtt_us`` and ``period_us`` of the steps after ``--warmup`` to an
``.npz`` file named by ``--out``::

    python -m benchmarks.rtt_peers zmq-server --bind tcp://127.0.0.1:5701
    python -m benchmarks.rtt_peers zmq-client --connect tcp://127.0.0.1:5701 --bytes 4096 \\
        --steps 5000 --warmup 500 --out /tmp/zmq.npz
    python -m benchmarks.rtt_peers unix-server --bind /tmp/rtt.sock --bytes 4096
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

ACTION_BYTES = 3 * 4
"""One action of the payload backend: float32[3]."""
REPLY_TIMEOUT_S = 10.0
"""Longest a client waits for the answer to one payload."""
WAIT_CLIENT_S = 60.0
"""Longest the unix socket server waits for its client to connect, or for its next
message, unless ``--wait-s`` says otherwise."""


def _save(path: str, rtt_us: list[float], period_us: list[float], warmup: int) -> None:
    np.savez(
        path,
        rtt_us=np.asarray(rtt_us[warmup:], dtype=np.float64),
        period_us=np.asarray(period_us[warmup:], dtype=np.float64),
    )


def run_worker(args: argparse.Namespace) -> int:
    from benchmarks.payload import PayloadBackend
    from gateway.episode import EpisodeBackend
    from gateway.protocol import Message
    from gateway.worker import EnvWorker

    class TimedWorker(EnvWorker):
        """EnvWorker that keeps the round trip of every step instead of only the last."""

        def __init__(self, backend: EpisodeBackend, address: str) -> None:
            super().__init__(backend, address, seed=0)
            self.rtt_us: list[float] = []
            self.period_us: list[float] = []
            self._last = 0.0

        def _apply_action(self, obs_msg: Message, action_msg: Message) -> Message:
            now = time.perf_counter()
            # EnvWorker._serve sets _rtt_us for this ACTION just before applying it.
            self.rtt_us.append(self._rtt_us)
            if self._last:
                self.period_us.append((now - self._last) * 1e6)
            else:
                self.period_us.append(float("nan"))
            self._last = now
            return super()._apply_action(obs_msg, action_msg)

    backend = PayloadBackend(args.bytes, dtype=args.dtype, max_episode_steps=args.episode_steps)
    worker = TimedWorker(backend, args.connect)
    signal.signal(signal.SIGTERM, lambda *_: worker.stop_event.set())
    try:
        worker.run(max_steps=args.warmup + args.steps)
    finally:
        backend.close()
    if len(worker.rtt_us) < args.warmup + args.steps:
        log.error("stopped after %d of %d steps", len(worker.rtt_us), args.warmup + args.steps)
        return 1
    _save(args.out, worker.rtt_us, worker.period_us, args.warmup)
    return 0


def run_zmq_server(args: argparse.Namespace) -> int:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.rcvtimeo = 100  # wake up to notice SIGTERM; no poll() in the hot path
    sock.bind(args.bind)
    reply = bytes(ACTION_BYTES)
    copy = args.bytes < zmq.COPY_THRESHOLD
    stopping = {"now": False}

    def _stop(signum: int, frame: Any) -> None:
        stopping["now"] = True

    signal.signal(signal.SIGTERM, _stop)
    try:
        while not stopping["now"]:
            try:
                # Small messages are cheaper to receive as bytes, large ones as frames.
                route, _payload = sock.recv_multipart(copy=copy)
            except zmq.Again:
                continue
            sock.send_multipart([route, reply], copy=copy)
    finally:
        sock.close(linger=0)
        ctx.term()
    return 0


def _round_trips(args: argparse.Namespace, exchange: Callable[[np.ndarray], bool]) -> int:
    """Send ``--warmup + --steps`` payloads through ``exchange`` (it sends one and returns
    True once the reply is in, False after ``REPLY_TIMEOUT_S``), timing each round trip and
    the loop's period; save them to ``--out``. 1 when a reply never came."""
    rtt_us: list[float] = []
    period_us: list[float] = []
    last = 0.0
    for tick in range(args.warmup + args.steps):
        now = time.perf_counter()
        period_us.append((now - last) * 1e6 if last else float("nan"))
        last = now
        payload = np.full(args.bytes, tick % 251, dtype=np.uint8)
        sent = time.perf_counter()
        if not exchange(payload):
            log.error("no reply from the server within %.0f s at step %d", REPLY_TIMEOUT_S, tick)
            return 1
        rtt_us.append((time.perf_counter() - sent) * 1e6)
    _save(args.out, rtt_us, period_us, args.warmup)
    return 0


def run_zmq_client(args: argparse.Namespace) -> int:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvtimeo = int(REPLY_TIMEOUT_S * 1000)
    sock.connect(args.connect)
    copy = args.bytes < zmq.COPY_THRESHOLD

    def exchange(payload: np.ndarray) -> bool:
        sock.send(payload.data, copy=False)
        try:
            sock.recv(copy=copy)
        except zmq.Again:
            return False
        return True

    try:
        return _round_trips(args, exchange)
    finally:
        sock.close(linger=0)
        ctx.term()


def _connection(sock: Any, timeout_s: float) -> Any:
    """The :class:`multiprocessing.connection.Connection` a ``multiprocessing.Pipe`` gives
    each end (length-prefixed messages) over ``sock``, whose reads give up after
    ``timeout_s`` (``BlockingIOError``): a deadline the kernel keeps, where
    ``Connection.poll`` before each read would add a selector and a system call to every
    round trip (about 110 against 35 us at 4 KiB)."""
    import socket
    import struct
    from multiprocessing.connection import Connection

    whole = int(timeout_s)
    sock.setsockopt(
        socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", whole, int((timeout_s - whole) * 1e6))
    )
    return Connection(sock.detach())


def run_unix_server(args: argparse.Namespace) -> int:
    import socket

    reply, wait_s = bytes(ACTION_BYTES), args.wait_s
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(args.bind)
    listener.listen(1)
    listener.settimeout(wait_s)
    log.info("waiting up to %.3g s for the client on %s", wait_s, args.bind)
    try:
        sock, _ = listener.accept()
    except TimeoutError:
        log.error("no client within %.3g s", wait_s)
        return 1
    finally:
        listener.close()
    sock.setblocking(True)
    with _connection(sock, wait_s) as conn:
        while True:
            try:
                conn.recv_bytes()
            except EOFError:  # the client is done and closed its end
                return 0
            except BlockingIOError:
                log.error("the client sent nothing for %.3g s", wait_s)
                return 1
            conn.send_bytes(reply)


def run_unix_client(args: argparse.Namespace) -> int:
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(args.connect)
    with _connection(sock, REPLY_TIMEOUT_S) as conn:

        def exchange(payload: np.ndarray) -> bool:
            conn.send_bytes(payload)
            try:
                conn.recv_bytes()
            except BlockingIOError:
                return False
            return True

        return _round_trips(args, exchange)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.rtt_peers",
        description="Peers of the round-trip benchmark (started by `loopgate bench`).",
        epilog="example: python -m benchmarks.rtt_peers zmq-server --bind tcp://127.0.0.1:5701",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--log-level", default="WARNING")
    sub = p.add_subparsers(dest="role", required=True)
    for role, helptext in (
        ("zmq-server", "raw ROUTER answering each message with one action"),
        ("unix-server", "unix socket answering each message with one action (one client)"),
    ):
        server = sub.add_parser(role, help=helptext)
        server.add_argument("--bind", required=True)
        server.add_argument("--bytes", type=int, required=True, help="size of the messages it will get")
        if role == "unix-server":
            server.add_argument(
                "--wait-s",
                type=float,
                default=WAIT_CLIENT_S,
                help="longest wait for the client or its next message",
            )
    for role, helptext in (
        ("worker", "EnvWorker with a payload backend, against a gateway"),
        ("zmq-client", "raw DEALER sending payloads"),
        ("unix-client", "unix socket client sending payloads"),
    ):
        c = sub.add_parser(role, help=helptext)
        c.add_argument("--connect", required=True)
        c.add_argument("--bytes", type=int, required=True, help="observation size in bytes")
        c.add_argument("--steps", type=int, required=True, help="measured steps")
        c.add_argument("--warmup", type=int, default=200, help="steps run before measuring")
        c.add_argument("--out", required=True, help=".npz file for the measured steps")
        if role == "worker":
            c.add_argument("--dtype", default="uint8")
            c.add_argument("--episode-steps", type=int, default=100)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    roles = {
        "worker": run_worker,
        "zmq-server": run_zmq_server,
        "zmq-client": run_zmq_client,
        "unix-server": run_unix_server,
        "unix-client": run_unix_client,
    }
    return roles[args.role](args)


if __name__ == "__main__":
    sys.exit(main())
