"""Sockets: binding, connecting, CURVE authentication, and deadlines.

Every loopgate service binds with :func:`bind` and every peer connects with
:func:`connect`; both apply the same rules:

- bind to 127.0.0.1 unless configured otherwise; any other interface requires CURVE
  keys (``loopgate keys DIR`` makes them; see :class:`CurveKeys`);
- ``linger=0`` so a process never hangs on exit with unsent messages;
- bounded queues (high-water marks) so a slow peer creates backpressure, not memory
  growth.

A key folder holds ``server.key`` / ``server.key_secret`` (the services' identity),
``client.key`` / ``client.key_secret`` (the peers' identity) and ``authorized/``: the
public keys of clients a server accepts. A peer without an authorized key never
completes the handshake, so it can neither send nor receive.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import select
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from gateway.protocol import Limits, Message, Timeout, recv

log = logging.getLogger(__name__)

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


@dataclass(frozen=True)
class CurveKeys:
    """CURVE key material loaded from a folder made by :func:`make_keys`."""

    directory: Path
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def load(cls, directory: str | Path) -> CurveKeys:
        d = Path(directory)
        try:
            server_public, server_secret = zmq.auth.load_certificate(d / "server.key_secret")
            client_public, client_secret = zmq.auth.load_certificate(d / "client.key_secret")
        except (OSError, ValueError) as exc:
            raise ValueError(f"gateway.curve_keys: cannot load keys from {str(d)!r}: {exc}") from exc
        if server_secret is None or client_secret is None:
            raise ValueError(f"gateway.curve_keys: {str(d)!r} lacks secret keys")
        return cls(d, server_public, server_secret, client_public, client_secret)

    @property
    def authorized_dir(self) -> Path:
        return self.directory / "authorized"


def make_keys(directory: str | Path) -> Path:
    """Create server and client key pairs in ``directory`` and authorize the client."""
    d = Path(directory)
    (d / "authorized").mkdir(parents=True, exist_ok=True)
    for name in ("server", "client"):
        if (d / f"{name}.key_secret").exists():
            raise FileExistsError(f"{d / f'{name}.key_secret'} exists; refusing to overwrite keys")
    zmq.auth.create_certificates(d, "server")
    public, _ = zmq.auth.create_certificates(d, "client")
    Path(public).replace(d / "authorized" / "client.key")
    # Keep a copy beside the secret so load_certificate finds the pair's public half.
    (d / "client.key").write_bytes((d / "authorized" / "client.key").read_bytes())
    for secret in d.glob("*.key_secret"):
        os.chmod(secret, 0o600)
    return d


_authenticators: dict[int, ThreadAuthenticator] = {}


def _ensure_authenticator(ctx: zmq.Context[Any], keys: CurveKeys) -> None:
    key = id(ctx)
    if key in _authenticators:
        return
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(keys.authorized_dir))
    _authenticators[key] = auth


def make_socket(
    ctx: zmq.Context[Any], kind: int, *, sndhwm: int = 1000, rcvhwm: int = 1000
) -> zmq.Socket[Any]:
    sock: zmq.Socket[Any] = ctx.socket(kind)
    sock.linger = 0
    sock.sndhwm = sndhwm
    sock.rcvhwm = rcvhwm
    return sock


def endpoint(transport: str, host: str, port: int, ipc_dir: str | Path | None = None, name: str = "") -> str:
    """An address to bind: ``tcp://host:port`` (port 0 = any) or ``ipc://<dir>/<name>.sock``."""
    if transport == "ipc":
        if ipc_dir is None:
            raise ValueError("ipc transport needs a folder for its socket files")
        path = Path(ipc_dir) / f"{name}.sock"
        if len(str(path)) > 100:
            raise ValueError(
                f"ipc socket path {str(path)!r} is too long for a unix socket; use a shorter run folder"
            )
        return f"ipc://{path}"
    return f"tcp://{host}:{port}"


_inproc_names = itertools.count()


def inproc_address(name: str) -> str:
    """A fresh ``inproc://`` address for a socket pair inside this process. Never reused:
    closing a socket releases its inproc name only later, on ZeroMQ's reaper thread, so a
    name derived from an object (``id(self)``) could be taken again, by an object that
    reuses the memory, while still bound, and that bind failed ("Address already in
    use")."""
    return f"inproc://{name}-{os.getpid()}-{next(_inproc_names)}"


def bind(sock: zmq.Socket[Any], address: str, keys: CurveKeys | None = None) -> str:
    """Bind ``sock`` to ``address`` (``tcp://host:0`` picks a free port); return the real address.

    Refuses a non-loopback TCP address without CURVE keys.
    """
    if address.startswith("tcp://"):
        host = address[len("tcp://") :].rpartition(":")[0]
        if not is_loopback(host) and keys is None:
            raise ValueError(f"refusing to bind {address} without CURVE keys (set gateway.curve_keys)")
    if keys is not None:
        _ensure_authenticator(sock.context, keys)
        sock.curve_server = True
        sock.curve_publickey = keys.server_public
        sock.curve_secretkey = keys.server_secret
    if address.startswith("tcp://") and address.endswith(":0"):
        host = address[len("tcp://") : -2]
        port_num = sock.bind_to_random_port(f"tcp://{host}")
        return f"tcp://{host}:{port_num}"
    sock.bind(address)
    if address.startswith("tcp://"):
        return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    return address


def connect(sock: zmq.Socket[Any], address: str, keys: CurveKeys | None = None) -> None:
    """Connect ``sock`` as a client, with CURVE keys when the server requires them."""
    if keys is not None:
        sock.curve_publickey = keys.client_public
        sock.curve_secretkey = keys.client_secret
        sock.curve_serverkey = keys.server_public
    sock.connect(address)


def recv_within(sock: zmq.Socket[Any], timeout_s: float, limits: Limits | None = None) -> Message:
    """Receive one message or raise :class:`Timeout` after ``timeout_s`` seconds."""
    if not sock.poll(int(max(timeout_s, 0) * 1000)):
        raise Timeout(f"no answer within {timeout_s:.3g} s")
    return recv(sock, limits or Limits())


_POLLIN = int(zmq.POLLIN)
SELECT_FD_LIMIT = 1024
"""``select`` takes descriptors below ``FD_SETSIZE`` only."""


class Evented(Protocol):
    """A ZeroMQ socket, or what stands for one (:class:`gateway.local_link.WorkerSockets`)."""

    def getsockopt(self, option: int) -> Any: ...


def readable(sock: Evented) -> bool:
    """Whether a message waits on ``sock``: its events, without ``poll(0)``'s Poller built
    per call or an enum made by ``& zmq.POLLIN`` (1.6 against 2.4 us)."""
    return bool(cast(int, sock.getsockopt(zmq.EVENTS)) & _POLLIN)


def wait_readable(socks: Sequence[zmq.Socket[Any]], timeout_s: float) -> bool:
    """Wait until one of ``socks`` has a message, for at most ``timeout_s`` seconds, to the
    microsecond: ``zmq.poll`` counts whole milliseconds, so a batch due in 200 us would
    otherwise wait a whole one.

    A socket's ``FD`` only says that its state may have changed (edge-triggered), so its
    ``EVENTS`` are read before every wait and after every wake.
    """
    deadline = time.monotonic() + timeout_s
    fds = [cast(int, sock.getsockopt(zmq.FD)) for sock in socks]
    while True:
        if any(readable(sock) for sock in socks):
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if max(fds) >= SELECT_FD_LIMIT:  # past what select takes: whole milliseconds, as zmq.poll
            return bool(zmq.zmq_poll([(sock, _POLLIN) for sock in socks], math.ceil(left * 1e3)))
        select.select(fds, [], [], left)
