"""The trainer's side of the replay service: batches with several requests in flight.

::

    client = ReplayClient(endpoints["replay"]["sample"], prefetch=4)
    batch = client.sample(256, tables={"demos": 0.5, "online": 0.5}, timeout_s=5.0)
    batch["obs/joint_pos"], batch["action"], batch["reward"], batch["next_obs/joint_pos"]
    batch["discount"], batch["terminated"], batch["truncated"], batch["policy_version"]
    client.update_priorities(batch["key"], new_priorities)      # prioritized tables
    tensors = client.sample(256, tables="online", torch=True)   # pinned when CUDA is present
    client.close()

``tables`` is a table name, a list of names (equal shares) or ``{name: share}``; counts
per table are rounded so they add up to the batch size. ``sample`` keeps ``prefetch``
requests of the same shape in flight, so the next batch is usually ready when asked
for. Every request carries ``timeout_s``: the service answers ``deadline_exceeded``
(raised as :class:`SampleTimeout`, naming the empty or rate-limited table) when it
cannot serve in time; no answer at all within ``timeout_s`` plus a grace period raises
:class:`ReplayUnavailable`. A call never blocks forever.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import zmq

from gateway.protocol import (
    Message,
    MsgType,
    ProtocolError,
    RemoteError,
    Timeout,
    raise_for_error,
    recv,
    send,
)
from gateway.transport import CurveKeys, connect

log = logging.getLogger(__name__)

GRACE_S = 2.0
"""Extra wait for an answer past a request's own timeout (transport, a busy service)."""
INTERRUPT_CHECK_S = 0.2
"""How often a wait for an answer asks :attr:`ReplayClient.interrupted` whether to give up."""


class SampleTimeout(RemoteError, TimeoutError):
    """The service could not serve the batch within its timeout (empty or rate-limited table)."""


class ReplayUnavailable(Timeout):
    """No answer from the replay service at all."""


def split_counts(batch_size: int, tables: str | Sequence[str] | Mapping[str, float]) -> dict[str, int]:
    """Items per table for ``batch_size`` and the given shares (largest remainder)."""
    if isinstance(tables, str):
        return {tables: batch_size}
    shares = dict(tables) if isinstance(tables, Mapping) else {name: 1.0 for name in tables}
    if not shares or any(v < 0 for v in shares.values()) or sum(shares.values()) <= 0:
        raise ValueError(f"tables must name at least one table with a positive share, got {tables!r}")
    total = sum(shares.values())
    exact = {k: batch_size * v / total for k, v in shares.items()}
    counts = {k: int(v) for k, v in exact.items()}
    for k in sorted(exact, key=lambda k: exact[k] - counts[k], reverse=True)[
        : batch_size - sum(counts.values())
    ]:
        counts[k] += 1
    return counts


class ReplayClient:
    """DEALER to the service's ``sample`` socket; not thread-safe (one per thread)."""

    def __init__(
        self,
        address: str,
        *,
        prefetch: int = 2,
        keys: CurveKeys | None = None,
        context: zmq.Context[Any] | None = None,
        interrupted: Callable[[], bool] | None = None,
    ) -> None:
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        self.address = address
        self.prefetch = prefetch
        self._ctx = context or zmq.Context.instance()
        self.sock: zmq.Socket[Any] = self._ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.rcvhwm = 0
        self.keys = keys
        connect(self.sock, address, keys)
        self._seq = 0
        self._inflight: deque[tuple[int, float]] = deque()
        """(seq, deadline) of SAMPLE requests sent for the current shape, oldest first."""
        self._shape: tuple[Any, ...] | None = None
        self._early: dict[int, Message] = {}
        self.interrupted = interrupted
        """Asked while an answer is awaited: True ends the wait with :class:`ReplayUnavailable`
        at once (a trainer told to stop does not wait out a service that is gone)."""

    def repoint(self, address: str) -> bool:
        """Dial the service at ``address`` from now on (it restarted on another node:
        :mod:`gateway.endpoints`); requests in flight to the old one are asked again
        there. Whether the address changed."""
        if address == self.address:
            return False
        old, self.address = self.address, address
        with contextlib.suppress(zmq.ZMQError):  # not connected there any more
            self.sock.disconnect(old)
        connect(self.sock, address, self.keys)
        self._inflight.clear()  # their answers would come from the old address: never
        self._early.clear()
        self._shape = None
        log.warning("replay service moved: %s -> %s; sampling there", old, address)
        return True

    # --------------------------------------------------------------- sample

    def sample(
        self,
        batch_size: int,
        *,
        tables: str | Sequence[str] | Mapping[str, float] = "online",
        timeout_s: float = 5.0,
        torch: bool = False,
    ) -> dict[str, Any]:
        """One batch; ``torch=True`` gives tensors (pinned memory when CUDA is available)."""
        counts = split_counts(batch_size, tables)
        shape = (tuple(counts.items()), float(timeout_s))
        if shape != self._shape:
            self._inflight.clear()  # answers to the old shape are dropped when they come
            self._early.clear()
            self._shape = shape
        while len(self._inflight) < self.prefetch:
            self._request(counts, timeout_s)
        seq, deadline = self._inflight.popleft()
        try:
            msg = self._wait(seq, deadline)
        except (RemoteError, ReplayUnavailable):
            self._inflight.clear()
            self._shape = None
            raise
        self._request(counts, timeout_s)  # keep the pipeline full
        arrays = dict(msg.arrays)
        return to_torch(arrays) if torch else arrays

    def take(self, counts: dict[str, int], *, timeout_s: float = 5.0) -> dict[str, Any]:
        """One batch of exactly ``counts`` items, from one request and nothing prefetched.

        For draining a queue table (``fifo``, ``max_times_sampled: 1``) of a known size:
        no second request waits in the service to take items meant for a later call.
        """
        self._inflight.clear()  # answers to earlier prefetched requests are dropped on arrival
        self._early.clear()
        self._shape = None
        self._seq += 1
        seq = self._seq
        send(
            self.sock,
            Message(MsgType.SAMPLE, seq=seq, meta={"tables": counts, "timeout_s": float(timeout_s)}),
        )
        return dict(self._checked(self._answer(seq, time.monotonic() + timeout_s + GRACE_S, "sample")).arrays)

    def _request(self, counts: dict[str, int], timeout_s: float) -> None:
        self._seq += 1
        meta = {"tables": counts, "timeout_s": float(timeout_s)}
        send(self.sock, Message(MsgType.SAMPLE, seq=self._seq, meta=meta))
        self._inflight.append((self._seq, time.monotonic() + timeout_s + GRACE_S))

    def _wait(self, seq: int, deadline: float) -> Message:
        if seq in self._early:
            return self._checked(self._early.pop(seq))
        return self._checked(self._answer(seq, deadline, "sample"))

    def _answer(self, seq: int, deadline: float, what: str) -> Message:
        """The message answering ``seq``; answers to other requests in flight are kept."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ReplayUnavailable(f"{what}: no answer from the replay service at {self.address}")
            if not self.sock.poll(int(min(remaining, INTERRUPT_CHECK_S) * 1000) + 1):
                if self.interrupted is not None and self.interrupted():
                    raise ReplayUnavailable(
                        f"{what}: interrupted waiting for the replay service at {self.address}"
                    )
                continue
            msg = recv(self.sock)
            if msg.seq == seq:
                return msg
            if any(s == msg.seq for s, _ in self._inflight):
                self._early[msg.seq] = msg
            # else: the answer to a request of an older shape, or to a fire-and-forget command

    @staticmethod
    def _checked(msg: Message) -> Message:
        if msg.type is MsgType.ERROR and msg.meta.get("code") == "deadline_exceeded":
            raise SampleTimeout(str(msg.meta["code"]), str(msg.meta.get("message", "")), msg.seq)
        return raise_for_error(msg)

    # ------------------------------------------------------------- commands

    def update_priorities(
        self, keys: np.ndarray, priorities: np.ndarray, *, wait_s: float | None = None
    ) -> int:
        """Send new priorities for sampled items (by ``batch["key"]``).

        Fire and forget by default; with ``wait_s`` wait for the count of keys applied
        (keys of items removed meanwhile are ignored).
        """
        keys = np.ascontiguousarray(np.asarray(keys, np.int64))
        prios = np.ascontiguousarray(np.asarray(priorities, np.float64))
        if keys.shape != prios.shape:
            raise ValueError(f"keys {keys.shape} and priorities {prios.shape} differ in shape")
        reply = self._command("update_priorities", {"key": keys, "priority": prios}, wait_s)
        return int(reply.get("applied", -1)) if reply is not None else -1

    def status(self, timeout_s: float = 5.0) -> dict[str, Any]:
        reply = self._command("status", {}, timeout_s)
        assert reply is not None
        return reply

    def _command(
        self, cmd: str, arrays: dict[str, np.ndarray], wait_s: float | None
    ) -> dict[str, Any] | None:
        self._seq += 1
        seq = self._seq
        send(self.sock, Message(MsgType.COMMAND, seq=seq, meta={"cmd": cmd}, arrays=arrays))
        if wait_s is None:
            return None
        return raise_for_error(self._answer(seq, time.monotonic() + wait_s, cmd)).meta

    def close(self) -> None:
        self.sock.close(linger=0)

    def __enter__(self) -> ReplayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def to_torch(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """Tensors owning their memory; pinned (for fast, async host-to-device copies) with CUDA."""
    import torch

    pin = torch.cuda.is_available()
    out: dict[str, Any] = {}
    for key, value in arrays.items():
        arr = value if value.flags.writeable else value.copy()  # views of receive buffers are read-only
        tensor = torch.from_numpy(arr)
        out[key] = tensor.pin_memory() if pin else tensor
    return out


__all__ = ["ProtocolError", "ReplayClient", "ReplayUnavailable", "SampleTimeout", "split_counts"]
