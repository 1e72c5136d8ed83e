"""The gateway's control socket from the outside: request/reply with deadlines.

The supervisor, the trainer and scripts use it::

    control = ControlClient(endpoints["gateway"]["control"])
    status = control.request("status", timeout_s=2.0)
    control.request("estop", engaged=True, reason="operator")

Any loopgate service with a control socket (the replay service's too) answers it.
"""

from __future__ import annotations

import time
from typing import Any

import zmq

from gateway.protocol import Message, MsgType, Timeout, raise_for_error, recv, send
from gateway.transport import CurveKeys, connect, make_socket

__all__ = ["ControlClient"]


class ControlClient:
    """Request/reply over a gateway's control socket, with deadlines."""

    def __init__(self, address: str, keys: CurveKeys | None = None) -> None:
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self.address, self.keys = address, keys
        self._sock: zmq.Socket[Any] | None = None
        self._dialled = address
        self._seq = 0

    def request(self, cmd: str, timeout_s: float = 2.0, **meta: Any) -> dict[str, Any]:
        """Send ``cmd`` and wait for its answer. After :attr:`address` changed (the gateway
        moved: :mod:`gateway.endpoints`), the request goes to the new address."""
        if self._sock is not None and self._dialled != self.address:
            self.close()
        if self._sock is None:
            self._sock = make_socket(self._ctx, zmq.DEALER)
            connect(self._sock, self.address, self.keys)
            self._dialled = self.address
        self._seq += 1
        send(self._sock, Message(MsgType.COMMAND, seq=self._seq, meta={"cmd": cmd, **meta}))
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._sock.poll(int(remaining * 1000)):
                # Drop the socket so a late answer cannot be taken for the next one.
                self._sock.close(linger=0)
                self._sock = None
                raise Timeout(f"{cmd}: no answer from {self.address} within {timeout_s} s")
            reply = recv(self._sock)
            if reply.seq == self._seq:
                return raise_for_error(reply).meta

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
