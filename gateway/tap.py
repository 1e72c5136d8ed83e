"""The observation tap: the newest observation of every env, for watchers, off the data path.

Each env worker publishes on a socket of its own (an XPUB; its address is
``endpoints.json["taps"][index]``, planned with the workers) what it just observed: every
observation key (camera images included), the step results (``step_info``), the action
it applied and that action's policy version. Nothing is sent while nobody listens (the
XPUB hears subscriptions come and go), at most ``max_hz`` messages a second are sent,
and a slow watcher loses messages rather than holding the worker: the send never blocks
and the socket queues two messages at most. The web console reads the taps to show
camera frames, joint states and rewards of any env without taking it over::

    tap = ObservationTap(ctx, "tcp://127.0.0.1:0", uid="w0")       # in the worker
    tap.publish(obs_msg, action, versions)                          # after each step

    reader = TapReader(ctx, [tap.address])                          # in a watcher
    latest = reader.poll(0.1)            # {uid: TapFrame}, newest message per worker

Message: ``OBSERVATION`` (seq: the worker's observation seq), meta ``{uid, t_publish}``,
arrays ``obs/<key>`` [K, ...], ``step_info`` f64[K, 8] (:mod:`gateway.steps`; its
``t_capture`` is when the observation, and a camera image in it, was rendered),
``action`` [K, ...] and ``policy_version`` i64[K] of the step that led here (absent
after a reset).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from gateway.protocol import Limits, Message, MsgType, ProtocolError, recv, send, unpack
from gateway.steps import StepInfo
from gateway.transport import bind, make_socket, readable

log = logging.getLogger(__name__)

TAP_LIMITS = Limits(max_frames=256, max_frame_bytes=64 << 20, max_message_bytes=256 << 20)
"""What a reader accepts from a tap (camera batches are large, and many)."""


class ObservationTap:
    """The worker's side: publish observations while someone listens, at most ``max_hz``."""

    def __init__(self, ctx: zmq.Context[Any], address: str, *, uid: str, max_hz: float = 30.0) -> None:
        if max_hz <= 0:
            raise ValueError(f"tap max_hz must be > 0, got {max_hz}")
        self.uid = uid
        self.min_interval_s = 1.0 / max_hz
        self.sock = make_socket(ctx, zmq.XPUB, sndhwm=2, rcvhwm=100)
        self.sock.setsockopt(zmq.XPUB_VERBOSER, 1)  # every (un)subscription, so they can be counted
        self.address = bind(self.sock, address)
        self.listeners = 0
        self.sent = 0
        self.dropped = 0
        self._last = 0.0
        self._heard = 0.0

    def _hear_subscriptions(self) -> None:
        while readable(self.sock):
            frame = self.sock.recv()
            if frame[:1] == b"\x01":
                self.listeners += 1
            elif frame[:1] == b"\x00":
                self.listeners = max(0, self.listeners - 1)

    def publish(self, obs_msg: Message, action: np.ndarray | None, versions: np.ndarray | None) -> bool:
        """Publish the worker's observation message (and the action that led to it);
        return whether it went out (nobody listening, too soon, or a full queue: not)."""
        now = time.monotonic()
        if now - self._heard >= self.min_interval_s:
            # Watchers come and go at human pace: heard at most max_hz times a second, not
            # once a step (a socket check is most of a tap's cost at 1 000 steps/s).
            self._hear_subscriptions()
            self._heard = now
        if not self.listeners or now - self._last < self.min_interval_s:
            return False
        arrays = {k: v for k, v in obs_msg.arrays.items() if k.startswith("obs/") or k == "step_info"}
        if action is not None:
            arrays["action"] = np.asarray(action)
        if versions is not None:
            arrays["policy_version"] = np.asarray(versions, np.int64)
        meta = {"uid": self.uid, "t_publish": time.time()}
        try:
            send(
                self.sock,
                Message(MsgType.OBSERVATION, seq=obs_msg.seq, meta=meta, arrays=arrays),
                flags=zmq.NOBLOCK,
            )
        except zmq.Again:
            self.dropped += 1
            return False
        self._last = now
        self.sent += 1
        return True

    def close(self) -> None:
        self.sock.close(linger=0)


@dataclass
class TapFrame:
    """One worker's newest tap message, decoded."""

    uid: str
    seq: int
    obs: dict[str, np.ndarray]
    info: StepInfo
    action: np.ndarray | None
    policy_version: np.ndarray | None
    t_publish: float
    t_received: float

    @property
    def num_envs(self) -> int:
        return len(self.info)


class TapReader:
    """The watcher's side: one SUB socket on every tap, newest message per worker."""

    def __init__(self, ctx: zmq.Context[Any], addresses: list[str], *, subscribe: bool = True) -> None:
        self.sock = make_socket(ctx, zmq.SUB, rcvhwm=8)
        if subscribe:
            self.sock.subscribe(b"")
        for address in addresses:
            self.sock.connect(address)
        self.addresses = list(addresses)
        self.malformed = 0

    def subscribed(self, on: bool) -> None:
        """Start (or stop) hearing the taps: they publish only while someone subscribes."""
        if on:
            self.sock.subscribe(b"")
        else:
            self.sock.unsubscribe(b"")

    def poll(self, timeout_s: float) -> dict[str, TapFrame]:
        """Wait up to ``timeout_s`` for messages; return the newest per worker uid."""
        out: dict[str, TapFrame] = {}
        if not self.sock.poll(int(timeout_s * 1000)):
            return out
        while self.sock.poll(0):
            try:
                msg = recv(self.sock, TAP_LIMITS)
                frame = self._frame(msg)
            except (ProtocolError, KeyError, ValueError, TypeError) as exc:
                self.malformed += 1
                if self.malformed <= 5:
                    log.warning("tap message refused: %s", exc)
                continue
            out[frame.uid] = frame
        return out

    @staticmethod
    def _frame(msg: Message) -> TapFrame:
        uid = msg.meta["uid"]
        info = msg.arrays["step_info"]
        if not isinstance(uid, str) or info.ndim != 2:
            raise ValueError("a tap message needs meta uid and a step_info [K, 8]")
        return TapFrame(
            uid=uid,
            seq=msg.seq,
            obs=unpack("obs", msg.arrays),
            info=StepInfo(info),
            action=msg.arrays.get("action"),
            policy_version=msg.arrays.get("policy_version"),
            t_publish=float(msg.meta.get("t_publish", 0.0)),
            t_received=time.time(),
        )

    def close(self) -> None:
        self.sock.close(linger=0)
