"""The worker link on one host: a unix stream socket beside the gateway's ZeroMQ socket.

Over ZeroMQ every message wakes three threads on its way (the sender's I/O thread, the
receiver's I/O thread, the receiver); over a unix socket it wakes one. With 16 envs
in two workers the gateway's loop serves 18-28 % more steps a second this way
(docs/performance.md). The link carries exactly the frames the ZeroMQ link carries
(:mod:`gateway.protocol.codec`), each message length-prefixed::

    <u32 bytes after this header> <u16 frames> <u32 length> * frames   frame bytes ...

so everything above it (HELLO, resends of unacknowledged steps, heartbeats, errors,
shared-memory handles) is the same protocol, and a worker that cannot use it dials
ZeroMQ as before:

- the gateway offers the link when ``gateway.local_link`` is ``auto`` (the default),
  its workers' address is on this host (loopback ``tcp://`` or ``ipc://``) and no CURVE
  keys are configured (a unix socket has no CURVE: authenticated runs keep ZeroMQ); it
  listens on a Linux abstract socket named after that address (:func:`link_name`), so
  nothing is left on disk whatever dies, and only the process that bound the address
  can own the name;
- a worker with the same setting tries the link first at every (re)connection and falls
  back to ZeroMQ when nothing listens there (the gateway is not up yet, runs with the
  link off, or is an older one), logging which it uses; a gateway with the link says so
  in WELCOME (``local_link: true``), and a worker that registered over ZeroMQ because it
  started first registers again over the link before its first step;
- either side dying closes the stream: the gateway drops the connection (the worker's
  session then times out as over ZeroMQ, ``worker_timeout_s``), the worker reconnects at
  once and sends its unacknowledged steps again;
- a header the peer could not have sent (more frames or bytes than ``gateway.limits``
  allow) ends the connection with a logged error: a byte stream cannot be resynchronised;
  a message that frames correctly but decodes wrongly is answered with an ERROR, as over
  ZeroMQ;
- the gateway never blocks on a worker: it writes without blocking, keeps what a slow
  worker has not read yet (at most :data:`MAX_PENDING_BYTES`, then it drops that
  connection), and finishes the write when the socket drains. A worker's own writes
  block at most its gateway timeout.

:class:`WorkerSockets` is the gateway's side: the ZeroMQ ROUTER and the links behind
the calls the codec makes on a socket that is not ZeroMQ's (``send_multipart`` and
``recv_multipart``, a message whole, its route first; a link's route is ``b"L"`` and a
counter, ZeroMQ's own routes start with a zero byte). :class:`LocalLink` is the
worker's side, used where its DEALER was.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import logging
import math
import select
import socket
import struct
import sys
import time
from collections.abc import Sequence
from typing import Any

import zmq

from gateway.protocol import Limits
from gateway.protocol.codec import BufferFrame, recv_frames, send_frames
from gateway.shm import is_local

log = logging.getLogger(__name__)

HEADER = struct.Struct("<IH")
"""Bytes after the header (frame lengths and frames), number of frames."""
LENGTH = struct.Struct("<I")
READ_BYTES = 1 << 18
"""Most bytes one read takes from a connection (into a buffer kept for it: ``recv`` of
this size would map and unmap fresh memory every time, 24 against 6 us a 4 KiB message)."""
MAX_PENDING_BYTES = 64 << 20
"""What the gateway keeps for one worker that does not read; past it the connection is dropped."""
ROUTE_PREFIX = b"L"


class LinkError(Exception):
    """A stream that cannot go on (a header past the limits)."""


def link_name(address: str) -> bytes:
    """The abstract socket a gateway whose workers' address is ``address`` listens on."""
    return b"\0loopgate-workers-" + hashlib.sha256(address.encode()).hexdigest()[:24].encode()


def wanted(mode: str, address: str, keys: object | None) -> bool:
    """Whether a gateway offers, and a worker tries, the link (``gateway.local_link`` = ``mode``)."""
    return mode == "auto" and keys is None and sys.platform.startswith("linux") and is_local(address)


def _header(frames: Sequence[Any]) -> tuple[bytes, int]:
    """The header that goes before ``frames`` (buffers), and the message's whole size."""
    lengths = [len(f) if type(f) is bytes else memoryview(f).nbytes for f in frames]
    n = len(lengths)
    size = LENGTH.size * n + sum(lengths)
    return struct.pack(f"<IH{n}I", size, n, *lengths), HEADER.size + size


class Reader:
    """Cuts a byte stream into messages (lists of frame views), checking each header
    against ``limits`` before waiting for its body."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._buf = bytearray()

    def _check(self, buf: Any, pos: int) -> tuple[int, int]:
        """The size and frame count of the message whose header is at ``pos``; raises
        :class:`LinkError`."""
        size, n = HEADER.unpack_from(buf, pos)
        if not 1 <= n <= self.limits.max_frames:
            raise LinkError(f"a message of {n} frames (limit {self.limits.max_frames})")
        if size > self.limits.max_message_bytes + LENGTH.size * n or size < LENGTH.size * n:
            raise LinkError(f"a message of {size} bytes (limit {self.limits.max_message_bytes})")
        return int(size), int(n)

    def feed(self, data: bytes) -> list[list[memoryview]]:
        """The messages ``data`` completes (none, one or several); raises :class:`LinkError`.

        The frames are views of ``data`` (or of one copy of what was waiting with it):
        a whole message in one read, the usual case, is not copied."""
        if self._buf:
            self._buf += data
            if len(self._buf) < HEADER.size or len(self._buf) < HEADER.size + self._check(self._buf, 0)[0]:
                return []  # a large message arriving in pieces is copied once, when whole
            data, self._buf = bytes(self._buf), bytearray()
        view = memoryview(data)
        out: list[list[memoryview]] = []
        pos = 0
        end = len(view)
        while end - pos >= HEADER.size:
            size, n = self._check(view, pos)
            if end - pos - HEADER.size < size:
                break
            body = pos + HEADER.size
            lengths = struct.unpack_from(f"<{n}I", view, body)
            if sum(lengths) != size - LENGTH.size * n:
                raise LinkError("frame lengths do not add up to the message's size")
            at = body + LENGTH.size * n
            frames = []
            for length in lengths:
                frames.append(view[at : at + length])
                at += length
            out.append(frames)
            pos = body + size
        if pos < end:
            self._buf += view[pos:]
        return out


def poll(poller: zmq.Poller, timeout_ms: int, end: LocalLink | WorkerSockets | None) -> dict[Any, int]:
    """``poller.poll`` where ``end`` (registered with ``poller``) is reported under its own
    name, and only with a whole message: a poller knows it by its descriptor, whose
    readiness means bytes, and misses a message read with an earlier one (then this does
    not wait at all)."""
    if end is None:
        return dict(poller.poll(timeout_ms))
    waiting = end.pending
    events = dict(poller.poll(0 if waiting else timeout_ms))
    if waiting or end.reported(events):
        events[end] = zmq.POLLIN
    return events


def _frames(message: list[memoryview]) -> list[BufferFrame]:
    last = len(message) - 1
    return [BufferFrame(f, i < last) for i, f in enumerate(message)]


class LocalLink:
    """The worker's end: a connected unix socket used where its ZeroMQ DEALER was
    (``send``/``recv`` frame by frame, ``poll``, ``fileno`` for a poller, ``close``)."""

    def __init__(self, sock: socket.socket, limits: Limits, send_timeout_s: float) -> None:
        self.sock = sock
        self.closed = False
        """The gateway closed the stream, or it broke: reconnect."""
        self.sock.settimeout(send_timeout_s)
        self._reader = Reader(limits)
        self._ready: collections.deque[list[memoryview]] = collections.deque()
        self._poller = select.poll()
        self._poller.register(sock.fileno(), select.POLLIN)
        self._buffer = memoryview(bytearray(READ_BYTES))

    @classmethod
    def connect(cls, address: str, limits: Limits, send_timeout_s: float) -> LocalLink:
        """The link of the gateway whose workers' address is ``address``; ``OSError`` when
        nothing listens there."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(link_name(address))
        except OSError:
            sock.close()
            raise
        return cls(sock, limits, send_timeout_s)

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def pending(self) -> bool:
        """A whole message was read with an earlier one: a poller on :meth:`fileno` will not
        report it."""
        return bool(self._ready)

    def reported(self, events: dict[Any, int]) -> bool:
        """Whether a poller's ``events`` bring a whole message."""
        return self.fileno() in events and bool(self.poll(0))

    def send_multipart(self, msg_parts: Sequence[Any], flags: int = 0, copy: bool = True) -> None:
        """Send one message. A broken stream drops it (as ZeroMQ drops for a peer that is
        gone) and marks the link closed."""
        if self.closed:
            return
        head, total = _header(msg_parts)
        try:
            if int(flags) & zmq.NOBLOCK:
                if self.sock.sendmsg([head, *msg_parts], (), socket.MSG_DONTWAIT) != total:
                    raise OSError("the gateway did not take the whole message")
                return
            sent = self.sock.sendmsg([head, *msg_parts])
            if sent < total:
                rest = b"".join([head, *(memoryview(f).cast("B") for f in msg_parts)])
                self.sock.sendall(rest[sent:])
        except OSError as exc:  # timeout included: the stream is cut mid-message
            self._close(f"sending to the gateway failed: {exc}")

    def _close(self, why: str) -> None:
        if not self.closed:
            log.warning("local link to the gateway closed (%s)", why)
        self.closed = True

    def _read(self) -> None:
        """Take what the socket has, without blocking."""
        try:
            n = self.sock.recv_into(self._buffer, 0, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._close(str(exc))
            return
        if not n:
            self._close("the gateway ended it")
            return
        try:
            self._ready.extend(self._reader.feed(self._buffer[:n].tobytes()))
        except LinkError as exc:
            self._close(f"bad data from the gateway: {exc}")

    def poll(self, timeout: int | None = None, flags: int = zmq.POLLIN) -> int:
        """``POLLIN`` once a whole message is here, within ``timeout`` ms (None: forever);
        0 on timeout or when the link closed."""
        deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout / 1000
        while not self._ready:
            if self.closed:
                return 0
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self._poller.poll(None if wait is None else math.ceil(wait * 1000)):
                self._read()
            elif wait is not None:
                return 0
        return zmq.POLLIN

    def recv_multipart(self, flags: int = 0, copy: bool = True) -> list[BufferFrame]:
        """The next message; ``zmq.Again`` when no whole one is here (``NOBLOCK``) or the
        link closed while waiting."""
        if not self.poll(0 if int(flags) & zmq.NOBLOCK else None):
            raise zmq.Again()
        return _frames(self._ready.popleft())

    def close(self, linger: int | None = None) -> None:
        self.closed = True
        self.sock.close()


class _Conn:
    def __init__(self, sock: socket.socket, route: bytes, limits: Limits) -> None:
        self.sock = sock
        self.route = route
        self.reader = Reader(limits)
        self.pending: collections.deque[memoryview] = collections.deque()
        self.pending_bytes = 0


class WorkerSockets:
    """The gateway's workers socket: its ZeroMQ ROUTER and the local links, behind the
    calls the loop makes on a ROUTER (``recv`` gives the route first, ``send`` takes it
    first). Register it and :attr:`router` with the loop's poller."""

    def __init__(self, router: zmq.Socket[Any], address: str, limits: Limits) -> None:
        self.router = router
        self.limits = limits
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        try:
            self.listener.bind(link_name(address))
            self.listener.listen(128)
        except OSError:
            self.listener.close()
            raise
        self._epoll = select.epoll()
        self._epoll.register(self.listener.fileno(), select.EPOLLIN)
        self._conns: dict[bytes, _Conn] = {}
        self._by_fd: dict[int, _Conn] = {}
        self._ids = itertools.count(1)
        self._ready: collections.deque[list[Any]] = collections.deque()
        self._buffer = memoryview(bytearray(READ_BYTES))

    @classmethod
    def offer(cls, router: zmq.Socket[Any], address: str, mode: str, keys: object | None,
              limits: Limits) -> zmq.Socket[Any] | WorkerSockets:  # fmt: skip
        """``router`` with local links beside it when :func:`wanted`; else ``router`` alone."""
        if not wanted(mode, address, keys):
            return router
        try:
            links = cls(router, address, limits)
        except OSError as exc:
            log.warning("no local link for workers (%s); they use %s", exc, address)
            return router
        log.info("workers on this host connect over a unix socket (gateway.local_link: %s)", mode)
        return links

    def fileno(self) -> int:
        return self._epoll.fileno()

    @property
    def pending(self) -> bool:
        """A link's message waits, read with an earlier one: poll without waiting."""
        return bool(self._ready)

    def reported(self, events: dict[Any, int]) -> bool:
        """Whether a poller's ``events`` may bring a message (the loop asks ``zmq.EVENTS``)."""
        return self.router in events or self.fileno() in events

    @property
    def links(self) -> int:
        """Workers connected over a local link now."""
        return len(self._conns)

    @property
    def unsent_bytes(self) -> int:
        """Bytes kept for workers that have not read them yet."""
        return sum(conn.pending_bytes for conn in self._conns.values())

    # ------------------------------------------------------------------ reading

    def _pump(self) -> None:
        for fd, events in self._epoll.poll(0):
            if fd == self.listener.fileno():
                self._accept()
                continue
            conn = self._by_fd.get(fd)
            if conn is None:
                continue
            if events & select.EPOLLOUT:
                self._flush(conn)
            if events & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR) and conn.route in self._conns:
                self._read(conn)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("local link: accept failed: %s", exc)
                return
            sock.setblocking(False)
            route = ROUTE_PREFIX + next(self._ids).to_bytes(8, "big")
            conn = _Conn(sock, route, self.limits)
            self._conns[route] = conn
            self._by_fd[sock.fileno()] = conn
            self._epoll.register(sock.fileno(), select.EPOLLIN)
            log.debug("local link %s: a worker connected", route.hex())

    def _read(self, conn: _Conn) -> None:
        try:
            n = conn.sock.recv_into(self._buffer)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(conn, f"reading failed: {exc}")
            return
        if not n:
            self._drop(conn, "the worker closed it")
            return
        try:
            messages = conn.reader.feed(self._buffer[:n].tobytes())
        except LinkError as exc:
            log.error("local link %s: %s; closing the connection", conn.route.hex(), exc)
            self._drop(conn, "bad framing")
            return
        for message in messages:
            self._ready.append([conn.route, *message])

    def _drop(self, conn: _Conn, why: str) -> None:
        self._conns.pop(conn.route, None)
        self._by_fd.pop(conn.sock.fileno(), None)
        with contextlib.suppress(OSError, ValueError):
            self._epoll.unregister(conn.sock.fileno())
        conn.sock.close()
        log.info("local link %s closed: %s", conn.route.hex(), why)

    def getsockopt(self, option: int) -> int:
        """``zmq.EVENTS`` of both: ``POLLIN`` when a message waits on a link or the ROUTER."""
        if option != zmq.EVENTS:
            return int(self.router.getsockopt(option))
        if not self._ready:
            self._pump()
        if self._ready:
            return zmq.POLLIN
        return int(self.router.getsockopt(zmq.EVENTS))

    def recv_multipart(self, flags: int = 0, copy: bool = True) -> list[Any]:
        """The next message, its route first: a link's before the ROUTER's."""
        if not self._ready:
            self._pump()
        if not self._ready:
            return recv_frames(self.router, flags)
        route, *message = self._ready.popleft()
        return [BufferFrame(memoryview(route), True), *_frames(message)]

    # ------------------------------------------------------------------ writing

    def send_multipart(self, msg_parts: Sequence[Any], flags: int = 0, copy: bool = True) -> None:
        """One message, its route first. A route that is gone drops it (a ROUTER without
        ``router_mandatory`` does the same)."""
        route = msg_parts[0]
        if type(route) is bytes and route.startswith(ROUTE_PREFIX):
            conn = self._conns.get(route)
            if conn is not None and len(msg_parts) > 1:
                self._write(conn, msg_parts[1:])
            return
        send_frames(self.router, msg_parts, flags)

    def _write(self, conn: _Conn, frames: Sequence[Any]) -> None:
        head, total = _header(frames)
        sent = 0
        if not conn.pending:
            try:
                sent = conn.sock.sendmsg([head, *frames])
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as exc:
                self._drop(conn, f"writing failed: {exc}")
                return
            if sent == total:
                return
        # The rest waits for the socket to drain: copied, since the caller's arrays may change.
        whole = b"".join([head, *(memoryview(f).cast("B") for f in frames)])
        self._queue(conn, [memoryview(whole)[sent:]])

    def _queue(self, conn: _Conn, buffers: list[memoryview]) -> None:
        if not conn.pending:
            self._epoll.modify(conn.sock.fileno(), select.EPOLLIN | select.EPOLLOUT)
        conn.pending.extend(buffers)
        conn.pending_bytes += sum(b.nbytes for b in buffers)
        if conn.pending_bytes > MAX_PENDING_BYTES:
            self._drop(conn, f"the worker left {conn.pending_bytes} bytes unread")

    def _flush(self, conn: _Conn) -> None:
        while conn.pending:
            try:
                sent = conn.sock.sendmsg(list(itertools.islice(conn.pending, 64)))
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._drop(conn, f"writing failed: {exc}")
                return
            conn.pending_bytes -= sent
            while sent:
                head = conn.pending[0]
                if sent >= head.nbytes:
                    sent -= head.nbytes
                    conn.pending.popleft()
                else:
                    conn.pending[0] = head[sent:]
                    sent = 0
        self._epoll.modify(conn.sock.fileno(), select.EPOLLIN)

    def close(self, linger: int | None = None) -> None:
        for conn in list(self._conns.values()):
            self._drop(conn, "the gateway stops")
        self.listener.close()
        self._epoll.close()
        self.router.close(linger=0)
