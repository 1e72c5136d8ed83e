"""The console's view of the gateway: its status, polled, and the e-stop path.

Control connections never shared: the poller's, which asks for ``status`` every
``status_interval_s`` in its own thread, and the e-stop's, used only for ``estop`` and
``resume``, so a stop never waits behind a status request (or anything else the
console does). The web app's e-stop is :meth:`GatewayLink.estop_async`, on the server's
event loop itself (an asyncio ZeroMQ socket): no hand-over to a thread pool and back,
each of which costs a scheduling slice on a loaded machine::

    link = GatewayLink(endpoints, interval_s=0.25)
    link.start()
    link.fleet()              # the fleet view's data, from the last status
    link.estop(True, "console: viewer")
    await link.estop_async(True, "console: viewer")
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import zmq
import zmq.asyncio

from gateway.control_client import ControlClient
from gateway.protocol import Message, MsgType, RemoteError, Timeout, decode, raise_for_error
from gateway.protocol.codec import encode

log = logging.getLogger(__name__)


class GatewayLink:
    def __init__(self, endpoints: dict[str, Any], *, interval_s: float, backend: str = "") -> None:
        self.backend = backend
        self.control_address = endpoints["gateway"]["control"]
        self.clients_address = endpoints["gateway"]["clients"]
        self.interval_s = interval_s
        self._status_client = ControlClient(self.control_address)
        self._stop_client = ControlClient(self.control_address)
        self._stop_lock = threading.Lock()
        self._async_stop: tuple[asyncio.AbstractEventLoop, asyncio.Lock, zmq.asyncio.Socket] | None = None
        self._async_seq = 0
        self._lock = threading.Lock()
        self._status: dict[str, Any] = {}
        self._error: str | None = "no status yet"
        self._updated = 0.0
        self._quit = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="status", daemon=True)
        self.controlled_by_console: str | None = None
        """The worker this console has taken over, set by the app."""

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._quit.set()
        self._thread.join(timeout=5.0)
        self._status_client.close()
        with self._stop_lock:
            self._stop_client.close()
        if self._async_stop is not None:
            self._async_stop[2].close(linger=0)
            self._async_stop = None

    def _poll(self) -> None:
        while not self._quit.is_set():
            try:
                status = self._status_client.request("status", timeout_s=2.0)
                with self._lock:
                    self._status, self._error, self._updated = status, None, time.time()
            except (Timeout, RemoteError) as exc:
                with self._lock:
                    self._error = f"gateway: {exc}"
            self._quit.wait(self.interval_s)

    def status(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._status)

    def fleet(self) -> dict[str, Any]:
        """The fleet view: run-wide counters and one row per worker."""
        with self._lock:
            s, error, updated = self._status, self._error, self._updated
        lag = s.get("policy_lag") or {}
        policy = s.get("policy") or {}
        workers = []
        for w in s.get("workers", []):
            if w.get("client"):
                who = "console operator" if w.get("uid") == self.controlled_by_console else "client script"
            else:
                who = f"policy ({policy.get('kind', '?')})"
            workers.append(
                {
                    "uid": w.get("uid"),
                    "num_envs": w.get("num_envs"),
                    "env_steps": w.get("env_steps"),
                    "rtt_us": w.get("rtt_us"),
                    "silent_s": w.get("silent_s"),
                    "control": who,
                }
            )
        spec = s.get("spec") or {}
        return {
            "error": error,
            "updated": updated,
            "env_steps": s.get("env_steps"),
            "episodes": s.get("episodes"),
            "steps_per_s": s.get("steps_per_s"),
            "policy_kind": policy.get("kind"),
            "policy_version": s.get("policy_version"),
            "trainer_version": s.get("trainer_version"),
            "policy_lag_mean": lag.get("mean"),
            "policy_lag_max": lag.get("max"),
            "estopped": s.get("estopped"),
            "paused": s.get("paused"),
            "held": s.get("held"),
            "backend": self.backend,
            "task": spec.get("name"),
            "workers": workers,
        }

    def estop_line(self) -> None:
        """Open the e-stop's connection now (on the running event loop), not at the first e-stop."""
        self._async_line()

    def _async_line(self) -> tuple[asyncio.Lock, zmq.asyncio.Socket]:
        loop = asyncio.get_running_loop()
        if self._async_stop is None or self._async_stop[0] is not loop:
            if self._async_stop is not None:  # made on another (ended) event loop
                self._async_stop[2].close(linger=0)
            sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
            sock.linger = 0
            sock.connect(self.control_address)
            self._async_stop = (loop, asyncio.Lock(), sock)
        return self._async_stop[1], self._async_stop[2]

    async def estop_async(self, engaged: bool, reason: str, timeout_s: float = 2.0) -> dict[str, Any]:
        """:meth:`estop` on the running event loop; :class:`Timeout` after ``timeout_s``."""
        lock, sock = self._async_line()
        async with lock:
            self._async_seq += 1
            seq = self._async_seq
            command = Message(
                MsgType.COMMAND, seq=seq, meta={"cmd": "estop", "engaged": engaged, "reason": reason}
            )
            await sock.send_multipart(encode(command), copy=False)
            deadline = time.monotonic() + timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await sock.poll(int(left * 1000)):
                    # A fresh socket next time, so a late answer is not taken for the next one.
                    sock.close(linger=0)
                    self._async_stop = None
                    raise Timeout(f"estop: no answer from {self.control_address} within {timeout_s} s")
                reply = decode(await sock.recv_multipart(copy=False))
                if reply.seq == seq:
                    return raise_for_error(reply).meta

    def estop(self, engaged: bool, reason: str) -> dict[str, Any]:
        """Engage or lift the gateway's e-stop (every worker's backend; latched)."""
        with self._stop_lock:
            return self._stop_client.request("estop", timeout_s=2.0, engaged=engaged, reason=reason)
