"""The faults the chaos harness (:mod:`benchmarks.chaos`) injects besides signals.

- :class:`LinkProxy`: a TCP proxy between two services on loopback that delays,
  stalls, corrupts (drops bytes) and cuts connections, so reconnects, resends and
  deadlines run over a real socket. ZeroMQ runs over TCP, whose own retransmission hides
  packet loss from the application: what loss looks like from above is latency, a
  stall, or a reset connection, and those are what the proxy produces. Dropping bytes
  from the middle of a stream breaks ZMTP framing, so the peer drops the connection.
- :class:`DiskLimit`: a size-limited tmpfs mounted over a run folder's ``spool/`` or
  ``replay/`` (root only) and filled up with a file, then freed.
- :func:`fuzz_frames` and :func:`fuzz_endpoint`: malformed multipart messages sent to
  a service's ROUTER socket from a peer of its own, counting the answers. Every message
  is built to be refused: a fuzzed message never registers a worker, takes over an env,
  stores a chunk, swaps weights or runs a command.

::

    with LinkProxy("tcp://127.0.0.1:5555", seed=3) as proxy:   # workers connect to proxy.address
        proxy.set(delay_s=0.05, jitter_s=0.02)
        proxy.cut()
    result = fuzz_endpoint(address, n=10_000, seed=1, target="workers")
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import select
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

from gateway.protocol import PROTOCOL_VERSION, Message, MsgType, encode

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------ link


def _tcp_port(address: str) -> tuple[str, int]:
    if not address.startswith("tcp://"):
        raise ValueError(f"a link proxy needs a tcp:// address, got {address!r}")
    host, _, port = address[len("tcp://") :].rpartition(":")
    if host not in ("127.0.0.1", "localhost"):
        raise ValueError(f"the link proxy only runs on loopback, got {address!r}")
    return "127.0.0.1", int(port)


class LinkProxy:
    """Forwards TCP connections from ``address`` (its own loopback port) to ``upstream``.

    :meth:`set` changes the link at any time: ``delay_s`` (+ uniform ``jitter_s``) before
    each forwarded read, ``stall`` (forward nothing; bytes queue up as with a burst of
    losses), ``drop_p`` (probability that a read is discarded, which breaks the stream).
    :meth:`cut` resets every open connection (RST). Counters say what it did.
    """

    def __init__(self, upstream: str, *, seed: int = 0) -> None:
        self.upstream = _tcp_port(upstream)
        self.rng = random.Random(seed)
        self._lock = threading.Lock()
        self.delay_s = 0.0
        self.jitter_s = 0.0
        self.drop_p = 0.0
        self.stalled = False
        self.counters = {"connections": 0, "cuts": 0, "dropped_reads": 0, "bytes": 0}
        self._conns: list[tuple[socket.socket, socket.socket]] = []
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.address = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, name="proxy-accept", daemon=True)]
        self._threads[0].start()

    def set(
        self, *, delay_s: float = 0.0, jitter_s: float = 0.0, drop_p: float = 0.0, stall: bool = False
    ) -> None:
        with self._lock:
            self.delay_s, self.jitter_s, self.drop_p, self.stalled = delay_s, jitter_s, drop_p, stall

    def heal(self) -> None:
        self.set()

    def cut(self) -> int:
        """Reset every open connection; the number cut."""
        with self._lock:
            conns, self._conns = self._conns, []
        for a, b in conns:
            for s in (a, b):
                _reset(s)
        self.counters["cuts"] += len(conns)
        return len(conns)

    def _accept(self) -> None:
        self._listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=2.0)
            except OSError:
                _reset(client)  # upstream down: the peer sees a refused link and retries
                continue
            server.settimeout(None)
            with self._lock:
                self._conns.append((client, server))
            self.counters["connections"] += 1
            for src, dst in ((client, server), (server, client)):
                t = threading.Thread(target=self._pump, args=(src, dst), name="proxy-pump", daemon=True)
                t.start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self._stop.is_set():
                ready, _, _ = select.select([src], [], [], 0.2)
                if not ready:
                    continue
                data = src.recv(65536)
                if not data:
                    break
                # A stall holds what was read until it ends, as TCP holds unacked data.
                while self.stalled and not self._stop.is_set():
                    time.sleep(0.05)
                with self._lock:
                    delay = self.delay_s + self.rng.uniform(0, self.jitter_s)
                    drop = self.drop_p > 0 and self.rng.random() < self.drop_p
                if delay > 0:
                    time.sleep(delay)
                if drop:
                    self.counters["dropped_reads"] += 1
                    continue
                dst.sendall(data)
                self.counters["bytes"] += len(data)
        except (OSError, ValueError):  # ValueError: select on a socket cut() closed
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()

    def close(self) -> None:
        self._stop.set()
        self.cut()
        with contextlib.suppress(OSError):
            self._listener.close()
        for t in self._threads:
            t.join(timeout=2)

    def __enter__(self) -> LinkProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _reset(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        # Linger 0: close sends RST, the abrupt end a crashed host or a middlebox gives.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.close()


# ------------------------------------------------------------------------ disk


def can_mount() -> str | None:
    """None when this process may mount a tmpfs (root with CAP_SYS_ADMIN), else why not."""
    if os.geteuid() != 0:
        return "mounting a size-limited tmpfs needs root"
    probe = Path(f"/tmp/loopgate-mount-probe-{os.getpid()}")
    probe.mkdir(exist_ok=True)
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)], capture_output=True, text=True
        )
        if done.returncode != 0:
            return f"mount -t tmpfs failed: {done.stderr.strip() or done.returncode}"
        subprocess.run(["umount", str(probe)], capture_output=True)
        return None
    except FileNotFoundError:
        return "no mount command"
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()


class DiskLimit:
    """A ``size_mb`` tmpfs mounted at ``path`` (created empty); :meth:`fill` takes all its
    free space with a file, :meth:`free` deletes the file; :meth:`unmount` keeps the data
    (copied back into the folder underneath)."""

    def __init__(self, path: Path, size_mb: int) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0755", "tmpfs", str(self.path)],
            check=True,
            capture_output=True,
        )
        self.filler = self.path / ".chaos-filler"
        self.mounted = True

    def free_bytes(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def fill(self, leave_bytes: int = 0) -> int:
        """Write a file until the disk refuses (ENOSPC); the bytes it took. Unbuffered, so
        that no write is left for ``close`` to fail on."""
        written = 0
        block = b"\0" * (1 << 20)
        try:
            fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as exc:  # full already: the services took every byte themselves
            if exc.errno != errno.ENOSPC:
                raise
            return 0
        try:
            while (room := self.free_bytes() - leave_bytes) > 0:
                written += os.write(fd, block[: min(len(block), room)])
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
        finally:
            os.close(fd)
        return written

    def free(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.filler.unlink()

    def unmount(self) -> None:
        """Copy what the services wrote to the disk underneath, then unmount."""
        if not self.mounted:
            return
        self.free()
        keep = self.path.with_name(self.path.name + ".chaos-copy")
        subprocess.run(["cp", "-a", str(self.path), str(keep)], check=True)
        subprocess.run(["umount", "-l", str(self.path)], check=True, capture_output=True)
        self.mounted = False
        self.path.rmdir()
        keep.rename(self.path)


# ------------------------------------------------------------------------ fuzz

ANSWER_TYPES = {MsgType.ERROR, MsgType.REPLY, MsgType.HELD}

TARGETS = (
    "workers",
    "clients",
    "control",
    "inference-requests",
    "inference-weights",
    "inference-control",
    "replay-ingest",
    "replay-sample",
    "replay-control",
)
"""Endpoint kinds :func:`fuzz_frames` knows how to make invalid messages for."""

_UNSOLICITED = (MsgType.WELCOME, MsgType.CHUNK_ACK, MsgType.WEIGHTS_ACK, MsgType.BATCH, MsgType.HELD)


def _junk(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(7 if depth < 2 else 4)
    if kind == 0:
        return rng.randrange(-(2**40), 2**40)
    if kind == 1:
        return rng.random() * 10 ** rng.randrange(-3, 12)
    if kind == 2:
        return "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(12)))
    if kind == 3:
        return rng.choice([None, True, False, b"\xff\x00", -1, 0])
    if kind == 4:
        return [_junk(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {str(_junk(rng, depth + 1))[:12]: _junk(rng, depth + 1) for _ in range(rng.randrange(5))}


def _header(rng: random.Random, **fields: Any) -> bytes:
    base = {"v": PROTOCOL_VERSION, "t": int(MsgType.COMMAND), "s": rng.randrange(1 << 31), "m": {}, "a": []}
    base.update(fields)
    return bytes(msgpack.packb(base, use_bin_type=True))


def _semantic(rng: random.Random, target: str) -> list[Any]:
    """A message that decodes but that ``target`` must refuse."""
    seq = rng.randrange(1 << 31)
    if rng.random() < 0.3:
        return encode(Message(rng.choice(_UNSOLICITED), seq=seq, meta={"fuzz": _junk(rng)}))
    if rng.random() < 0.3:
        cmd = f"fuzz-{rng.randrange(1 << 30):x}"  # never one of the services' commands
        return encode(Message(MsgType.COMMAND, seq=seq, meta={"cmd": cmd, "x": _junk(rng)}))
    bad = np.frombuffer(rng.randbytes(8 * rng.randrange(1, 8)), dtype=np.float32)
    if target == "workers":
        # No valid spec: a HELLO never registers; an OBSERVATION from a stranger is refused.
        if rng.random() < 0.5:
            meta = {"spec": _junk(rng), "num_envs": rng.choice([0, -3, "x", 10**9])}
            return encode(Message(MsgType.HELLO, seq=seq, meta=meta))
        return encode(Message(MsgType.OBSERVATION, seq=seq, arrays={"obs/joint_pos": bad}))
    if target == "clients":
        # Never ``takeover``: in a policy-driven run a client HELLO is refused; STEP and
        # RESET from a client that never attached are refused.
        kind = rng.choice([MsgType.HELLO, MsgType.STEP, MsgType.RESET])
        meta = {"num_envs": rng.choice([0, -1, 10**9, "x"])} if kind is MsgType.HELLO else {}
        return encode(Message(kind, seq=seq, meta=meta, arrays={"action": bad}))
    if target == "inference-requests":
        return encode(Message(MsgType.OBSERVATION, seq=seq, arrays={f"obs/{_junk(rng)}"[:20]: bad}))
    if target == "inference-weights":
        # Version <= 0 is never newer than what a server holds: refused before it is staged.
        meta = {"version": -rng.randrange(0, 1 << 20), "bucket": _junk(rng)}
        return encode(Message(MsgType.WEIGHTS, seq=seq, meta=meta, arrays={"w": bad}))
    if target == "replay-ingest":
        # A chunk id that never matches episode_id:first_step: refused, never stored.
        meta = {"chunk_id": f"fuzz{rng.randrange(1 << 30)}", "episode_id": "fuzz", "first_step": 0}
        meta["num_steps"] = rng.choice([1, 0, -5])
        return encode(Message(MsgType.TRAJECTORY_CHUNK, seq=seq, meta=meta, arrays={"reward": bad}))
    if target == "replay-sample":
        tables = {f"fuzz-{rng.randrange(1 << 20)}": rng.choice([1, -1, 0, 10**12])}
        return encode(Message(MsgType.SAMPLE, seq=seq, meta={"tables": tables, "timeout_s": 0.01}))
    return encode(Message(MsgType.COMMAND, seq=seq, meta={"cmd": _junk(rng)}))


def fuzz_frames(rng: random.Random, target: str) -> list[Any]:
    """One malformed multipart message for an endpoint of kind ``target``."""
    kind = rng.randrange(12)
    if kind == 0:
        return [rng.randbytes(rng.randrange(0, 64))]
    if kind == 1:
        return [bytes(msgpack.packb(_junk(rng), use_bin_type=True))]
    if kind == 2:
        return [_header(rng, v=rng.choice([0, 2, 99, -1, "1", None]))]
    if kind == 3:
        return [_header(rng, t=rng.choice([0, 99, 255, -7, 2**40, "STEP"]))]
    if kind == 4:
        dtype = rng.choice(["object", "<U4", "complex64", "float128", ">f4", "", "O"])
        return [_header(rng, a=[["x", dtype, [2]]]), b"\0" * 8]
    if kind == 5:  # frame length != shape x itemsize
        n = rng.randrange(1, 64)
        return [_header(rng, a=[["x", "float32", [n]]]), rng.randbytes(4 * n + rng.choice([-1, 1, 3]))]
    if kind == 6:  # more or fewer frames than the header describes
        descr = [["x", "uint8", [1]]] * rng.randrange(0, 4)
        return [_header(rng, a=descr)] + [b"\1"] * (len(descr) + rng.choice([-1, 1, 2]) if descr else 1)
    if kind == 7:
        shape = rng.choice([[-1], [2**62, 2**62], [1] * 9, ["a"], [True], {"x": 1}, 3])
        return [_header(rng, a=[["x", "uint8", shape]]), b"\0"]
    if kind == 8:
        return [_header(rng, m=_junk(rng), s=rng.choice(["x", -1, 2**64 - 1, None]))]
    if kind == 9:
        header = bytes(msgpack.packb({"v": PROTOCOL_VERSION, "t": 14, "m": {}, "a": []}))
        return [header[: rng.randrange(1, len(header))]]  # truncated msgpack
    return _semantic(rng, target)


@dataclass
class FuzzResult:
    target: str
    address: str
    sent: int
    answered: int
    errors: dict[str, int]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def fuzz_endpoint(
    address: str, *, n: int, seed: int, target: str, timeout_s: float = 120.0, stop: Any = None
) -> FuzzResult:
    """Send ``n`` malformed messages to ``address`` (a ROUTER) from one DEALER, reading
    answers as they come; ends by ``timeout_s`` whatever the peer does."""
    rng = random.Random(seed)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 200)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(address)
    errors: dict[str, int] = {}
    sent = answered = 0
    started = time.monotonic()
    deadline = started + timeout_s
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN | zmq.POLLOUT)
    try:
        quiet_until = None
        while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
            events = dict(poller.poll(100))
            if events.get(sock, 0) & zmq.POLLIN:
                for _ in range(1000):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    answered += 1
                    _count_answer(frames, errors)
            if sent < n and events.get(sock, 0) & zmq.POLLOUT:
                with contextlib.suppress(zmq.Again):
                    sock.send_multipart(fuzz_frames(rng, target), zmq.NOBLOCK)
                    sent += 1
            if sent >= n:
                # Give the answers to the last messages a moment to arrive.
                quiet_until = quiet_until or time.monotonic() + 2.0
                if answered >= sent or time.monotonic() > quiet_until:
                    break
    finally:
        sock.close(linger=0)
    return FuzzResult(target, address, sent, answered, errors, round(time.monotonic() - started, 2))


def _count_answer(frames: list[bytes], errors: dict[str, int]) -> None:
    try:
        header = msgpack.unpackb(frames[0], raw=False)
        code = str(header.get("m", {}).get("code", "-")) if int(header.get("t", 0)) == MsgType.ERROR else "ok"
    except (ValueError, TypeError, AttributeError, msgpack.ExtraData, msgpack.FormatError):
        code = "undecodable"
    errors[code] = errors.get(code, 0) + 1


def endpoints_to_fuzz(endpoints: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """``(target kind, address)`` for every socket of a run's ``endpoints.json``."""
    gw = endpoints.get("gateway", {})
    for name in ("workers", "clients", "control"):
        if name in gw:
            yield name, gw[name]
    for replica in endpoints.get("inference", []) or []:
        for name in ("requests", "weights", "control"):
            if name in replica:
                yield f"inference-{name}", replica[name]
    replay = endpoints.get("replay", {}) or {}
    for name in ("ingest", "sample", "control"):
        if name in replay:
            yield f"replay-{name}", replay[name]


def answers(address: str, msg: Message, timeout_s: float = 10.0) -> bool:
    """Whether a well-formed request to ``address`` gets a reply that is not an ERROR."""
    from gateway.protocol import recv, send

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        send(sock, msg)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(int(left * 1000)):
                return False
            reply = recv(sock)
            if reply.seq == msg.seq:
                return reply.type is not MsgType.ERROR
        return False
    finally:
        sock.close(linger=0)


def good_requests(endpoints: dict[str, Any]) -> list[tuple[str, str, Message]]:
    """A well-formed request for each control socket of a run: ``(name, address, message)``."""
    status = Message(MsgType.COMMAND, seq=424242, meta={"cmd": "status"})
    out = [("gateway control", endpoints["gateway"]["control"], status)]
    for i, replica in enumerate(endpoints.get("inference", []) or []):
        out.append((f"inference-{i} control", replica["control"], Message(MsgType.METADATA, seq=424242)))
    if endpoints.get("replay"):
        out.append(("replay control", endpoints["replay"]["control"], status))
    return out
