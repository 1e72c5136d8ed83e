"""The robot view's live feed: camera frames and env state from the workers' taps.

A :class:`FrameSource` thread reads every worker's observation tap (:mod:`gateway.tap`,
addresses in ``endpoints.json["taps"]``) and keeps the newest message per worker. It
subscribes only while a viewer is connected or a recording needs the env's step, so
with nobody watching the workers publish nothing. Each viewer opens one
WebSocket, ``/ws/camera``, and says what to watch::

    -> {"type": "watch", "worker": "host-123-ab12cd", "env": 0}
    <- binary: u32 big-endian header length, the header (JSON), the frame (JPEG; absent
       when the env renders no camera)
    -> {"type": "ack", "seq": 41}          # after drawing frame 41

The header holds the worker, env, ``seq``, ``t_render_ms`` (when the observation and
its camera image were rendered, unix ms: the ``t_capture`` of the step), ``t_sent_ms``,
the episode, step, reward, success/terminated/truncated flags, ``joint_pos``,
``joint_vel``, the ``action`` that led here and its ``policy_version``. The server sends
a viewer a frame only when it is newer than the last one sent and at most
:data:`IN_FLIGHT` frames are not yet acknowledged, so it holds only the newest frame per
viewer and drops the rest: a slow viewer sees fewer frames, never older ones. JPEG is
encoded once per frame and env, however many viewers watch it.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import struct
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import zmq
from fastapi import FastAPI, WebSocket, WebSocketDisconnect

from gateway.tap import TapFrame, TapReader

log = logging.getLogger(__name__)

IN_FLIGHT = 2
"""Frames a viewer may have unacknowledged; the rest wait (only the newest is kept)."""
JPEG_QUALITY = 80
STATE_KEYS = ("joint_pos", "joint_vel")


def camera_key(obs: dict[str, np.ndarray]) -> str | None:
    """The first observation that is a camera batch (uint8 [K, H, W, 3])."""
    for key, arr in obs.items():
        if arr.dtype == np.uint8 and arr.ndim == 4 and arr.shape[-1] == 3:
            return key
    return None


def encode_jpeg(image: np.ndarray, quality: int = JPEG_QUALITY) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(image)).save(out, format="JPEG", quality=quality)
    return out.getvalue()


def _floats(arr: np.ndarray | None, env: int) -> list[float] | None:
    if arr is None or env >= len(arr):
        return None
    return [round(float(v), 5) for v in np.asarray(arr[env], np.float64).ravel()]


def frame_header(frame: TapFrame, env: int) -> dict[str, Any]:
    """What the page shows of ``env`` in ``frame`` besides the picture."""
    info = frame.info
    header: dict[str, Any] = {
        "type": "frame",
        "worker": frame.uid,
        "env": env,
        "num_envs": frame.num_envs,
        "seq": frame.seq,
        "t_render_ms": float(info.t_capture[env]) * 1000.0,
        "episode": int(info.episode[env]),
        "step": int(info.step[env]),
        "reward": round(float(info.reward[env]), 5),
        "success": bool(info.success[env]),
        "terminated": bool(info.terminated[env]),
        "truncated": bool(info.truncated[env]),
        "action": _floats(frame.action, env),
        "policy_version": int(frame.policy_version[env]) if frame.policy_version is not None else None,
    }
    for key in STATE_KEYS:
        header[key] = _floats(frame.obs.get(key), env)
    return header


class FrameSource:
    """Reads the taps in a thread; the newest frame per worker, JPEGs encoded once."""

    def __init__(self, addresses: list[str], ctx: zmq.Context[Any] | None = None) -> None:
        self.addresses = list(addresses)
        self._ctx = ctx or zmq.Context.instance()
        self._lock = threading.Lock()
        self.latest: dict[str, TapFrame] = {}
        self._jpegs: dict[tuple[str, int, int], bytes] = {}
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="console-frames", daemon=True)
        self.frames = 0
        self.wanted = 0
        """Viewers and recordings that need frames; the taps publish only while it is > 0."""
        self.encoder = ThreadPoolExecutor(max_workers=2, thread_name_prefix="console-jpeg")
        """JPEG encoding, apart from the web server's thread pool (the e-stop's path)."""
        self._fresh = threading.Condition(self._lock)

    def want(self, delta: int) -> None:
        """One more (+1) or one less (-1) user of the frames."""
        with self._lock:
            self.wanted = max(0, self.wanted + delta)

    def start(self) -> None:
        if self.addresses:
            self._thread.start()

    def _run(self) -> None:
        reader = TapReader(self._ctx, self.addresses, subscribe=False)
        subscribed = False
        try:
            while not self._stop.is_set():
                if (self.wanted > 0) != subscribed:  # nobody watching: the workers publish nothing
                    subscribed = not subscribed
                    reader.subscribed(subscribed)
                fresh = reader.poll(0.1)
                if not fresh:
                    continue
                with self._lock:
                    self.latest.update(fresh)
                    self._fresh.notify_all()
                    self.frames += len(fresh)
                    live = {(f.uid, f.seq) for f in self.latest.values()}
                    self._jpegs = {k: v for k, v in self._jpegs.items() if (k[0], k[1]) in live}
                    waiters, self._waiters = self._waiters, []
                for loop, event in waiters:
                    loop.call_soon_threadsafe(event.set)
        finally:
            reader.close()

    def current(self, uid: str, timeout_s: float = 3.0) -> TapFrame:
        """A frame of ``uid`` at most 0.5 s old, waiting up to ``timeout_s`` for one;
        :class:`LookupError` naming the worker when none comes."""
        self.want(1)
        try:
            deadline = time.monotonic() + timeout_s
            with self._lock:
                while True:
                    frame = self.latest.get(uid)
                    if frame is not None and time.time() - frame.t_received < 0.5:
                        return frame
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise LookupError(f"no observation of worker {uid!r} arrived within {timeout_s:g} s")
                    self._fresh.wait(left)
        finally:
            self.want(-1)

    async def wait_newer(self, uid: str, seq: int, timeout_s: float) -> TapFrame | None:
        """The newest frame of ``uid`` once its seq is past ``seq``; None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            event = asyncio.Event()
            with self._lock:
                frame = self.latest.get(uid)
                if frame is not None and frame.seq != seq:
                    return frame
                self._waiters.append((asyncio.get_running_loop(), event))
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(event.wait(), left)
            except TimeoutError:
                return None

    def jpeg(self, frame: TapFrame, env: int) -> bytes | None:
        """``env``'s camera image of ``frame`` as JPEG (None: no camera), encoded once."""
        key = camera_key(frame.obs)
        if key is None:
            return None
        cache = (frame.uid, frame.seq, env)
        with self._lock:
            cached = self._jpegs.get(cache)
        if cached is not None:
            return cached
        data = encode_jpeg(frame.obs[key][env])
        with self._lock:
            self._jpegs[cache] = data
        return data

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        self.encoder.shutdown(wait=False, cancel_futures=True)


def pack_frame(header: dict[str, Any], jpeg: bytes | None) -> bytes:
    head = json.dumps(header).encode()
    return struct.pack(">I", len(head)) + head + (jpeg or b"")


def parse_watch(msg: Any) -> tuple[str, int] | str:
    """``(worker, env)`` from a watch message, or the error text for the page."""
    if not isinstance(msg, dict):
        return "camera messages must be JSON objects"
    worker, env = msg.get("worker"), msg.get("env", 0)
    if not isinstance(worker, str) or not worker or len(worker) > 200:
        return f"watch needs a worker uid, got {worker!r}"
    if not isinstance(env, int) or isinstance(env, bool) or not 0 <= env < 1_000_000:
        return f"watch needs env as a non-negative integer, got {env!r}"
    return worker, env


class Viewer:
    """One viewer's WebSocket: what it watches and how many frames it has not acknowledged."""

    def __init__(self, ws: WebSocket, source: FrameSource) -> None:
        self.ws = ws
        self.source = source
        self.target: tuple[str, int] | None = None
        self.sent_seq = -1
        self.in_flight = 0
        self.changed = asyncio.Event()

    async def receive(self) -> None:
        while True:
            text = await self.ws.receive_text()
            try:
                msg = json.loads(text)
            except ValueError:
                await self.ws.send_text(json.dumps({"type": "error", "message": "messages must be JSON"}))
                continue
            kind = msg.get("type") if isinstance(msg, dict) else None
            if kind == "ack":
                self.in_flight = max(0, self.in_flight - 1)
            elif kind == "watch":
                parsed = parse_watch(msg)
                if isinstance(parsed, str):
                    await self.ws.send_text(json.dumps({"type": "error", "message": parsed}))
                    continue
                self.target, self.sent_seq, self.in_flight = parsed, -1, 0
            else:
                await self.ws.send_text(
                    json.dumps({"type": "error", "message": f"unknown camera message {kind!r}"})
                )
                continue
            self.changed.set()

    async def send_frames(self) -> None:
        while True:
            if self.target is None or self.in_flight >= IN_FLIGHT:
                self.changed.clear()
                await self.changed.wait()
                continue
            uid, env = self.target
            frame = await self.source.wait_newer(uid, self.sent_seq, 0.5)
            if frame is None or (uid, env) != self.target:
                continue
            if env >= frame.num_envs:
                await self.ws.send_text(
                    json.dumps({"type": "error", "message": f"worker {uid} has envs 0..{frame.num_envs - 1}"})
                )
                self.target = None
                continue
            # On the frames' own threads: encoding never takes a thread the e-stop's POST needs.
            jpeg = await asyncio.get_running_loop().run_in_executor(
                self.source.encoder, self.source.jpeg, frame, env
            )
            header = frame_header(frame, env)
            header["t_sent_ms"] = time.time() * 1000.0
            header["image"] = jpeg is not None
            await self.ws.send_bytes(pack_frame(header, jpeg))
            self.sent_seq = frame.seq
            self.in_flight += 1


def install(app: FastAPI, source: FrameSource, admit: Callable[[WebSocket], Awaitable[Any]]) -> None:
    """Add ``/ws/camera`` to ``app``; ``admit`` checks the session and the Origin."""

    @app.websocket("/ws/camera")
    async def camera_ws(ws: WebSocket) -> None:
        if await admit(ws) is None:
            return
        viewer = Viewer(ws, source)
        source.want(1)
        sender = asyncio.create_task(viewer.send_frames())
        try:
            await viewer.receive()
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            sender.cancel()
            source.want(-1)
