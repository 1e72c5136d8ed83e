"""The env worker: :class:`EnvWorker` (see :mod:`gateway.worker` for the protocol)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from gateway import local_link, shm, steps
from gateway.cuda_ipc import CudaRing
from gateway.endpoints import lookup
from gateway.endpoints import read as read_endpoints
from gateway.episode import EpisodeBackend, Obs
from gateway.local_link import LocalLink
from gateway.protocol import ErrorCode, Limits, Message, MsgType, ProtocolError, pack, recv, send
from gateway.tap import ObservationTap
from gateway.trajectory import episode_id
from gateway.transport import CurveKeys, connect, make_socket
from gateway.worker.busy import BusyBeat

log = logging.getLogger(__name__)

EXIT_CONFIG = 2
"""Exit status for errors a restart cannot fix (spec mismatch, bad options)."""


def action_versions(msg: Message, n: int) -> np.ndarray:
    """Policy version per env of an ACTION: ``meta["version"]`` when uniform, else the array."""
    if "policy_version" in msg.arrays:
        return np.asarray(msg.arrays["policy_version"], dtype=np.int64)
    return steps.filled(n, int(msg.meta.get("version", 0)), np.int64)


class FatalWorkerError(Exception):
    """The gateway refused this worker for a reason a restart cannot fix."""


class EnvWorker:
    """Runs one :class:`EpisodeBackend` behind a gateway."""

    def __init__(
        self,
        backend: EpisodeBackend,
        address: str,
        *,
        seed: int | None = 0,
        uid: str | None = None,
        heartbeat_s: float = 1.0,
        gateway_timeout_s: float = 5.0,
        keys: CurveKeys | None = None,
        limits: Limits | None = None,
        context: zmq.Context[Any] | None = None,
        tap_address: str | None = None,
        shared_memory: str = "auto",
        endpoints: str | Path | None = None,
        cuda_ipc: str = "auto",
        local_link: str = "auto",
    ) -> None:
        self.backend = backend
        self.address = address
        self.endpoints = None if endpoints is None else Path(endpoints)
        """The run's ``endpoints.json``, read again at each reconnect: a gateway restarted on
        another node (:mod:`gateway.endpoints`) is found at its new address."""
        self.seed = seed
        self.uid = uid or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.heartbeat_s = heartbeat_s
        self.gateway_timeout_s = gateway_timeout_s
        self.keys = keys
        self.limits = limits or Limits()
        self._ctx = context or zmq.Context.instance()
        self._sock: zmq.Socket[Any] | LocalLink | None = None
        self._bus: zmq.Socket[Any] | None = None
        """The gateway's e-stop bus (:mod:`gateway.hub.estop`), subscribed after WELCOME."""
        self._polled: tuple[tuple[Any, Any], zmq.Poller] | None = None
        self._estop_epoch = 0
        """The newest e-stop command applied: a command that is not newer is a duplicate
        (the bus and the workers' socket both carry each one) or superseded."""
        n = backend.num_envs
        self._episode = np.zeros(n, dtype=np.int64)
        self._step = np.zeros(n, dtype=np.int64)
        self._seq = 0
        self._last_obs_msg: Message | None = None
        self._prev: dict[str, np.ndarray] | None = None
        self._unacked: list[Message] = []
        """Observations (with ``prev/*``) whose steps no answer acknowledged yet, oldest
        first: sent again, as replays, after a reconnect (:mod:`gateway.hub.durability`)."""
        self._rtt_us = 0.0
        self.acked_steps = 0
        self.env_steps = 0
        self.reconnects = 0
        self.stop_event = threading.Event()
        self._last_beat = 0.0
        backend.keepalive = self._keepalive
        self._busy = BusyBeat(heartbeat_s, self._busy_heartbeat)
        self.shared_memory = shared_memory
        """``gateway.shared_memory``: offer the gateway a shared-memory ring (:mod:`gateway.shm`)."""
        self.local_link = local_link
        """``gateway.local_link``: try the gateway's unix socket before ZeroMQ (:mod:`gateway.local_link`)."""
        self._link_logged: bool | None = None
        self.shm: shm.ShmWriter | None = None
        """The ring the gateway accepted for this connection (None: frames)."""
        self.cuda_ipc = cuda_ipc
        """``gateway.cuda_ipc``: offer a ring of GPU buffers too (:mod:`gateway.cuda_ipc`)."""
        self.cuda: CudaRing | None = None
        """This worker's GPU ring, made once and offered at every HELLO (None: none)."""
        self._cuda_made = False
        self.tap: ObservationTap | None = None
        self._tapped: tuple[np.ndarray | None, np.ndarray | None] = (None, None)
        """The action (and its versions) that led to the observation being sent."""
        if tap_address:
            try:
                self.tap = ObservationTap(self._ctx, tap_address, uid=self.uid)
            except (zmq.ZMQError, ValueError) as exc:  # watchers only: the worker serves without
                log.warning("observation tap %s not available: %s", tap_address, exc)

    # --------------------------------------------------------------- connection

    def _connect(self) -> zmq.Socket[Any] | LocalLink:
        if self._sock is not None:
            self._sock.close(linger=0)
        if self.endpoints is not None:
            try:
                moved = lookup(read_endpoints(self.endpoints), "gateway", "workers")
            except (OSError, ValueError) as exc:  # half-written by hand: the old address
                log.warning("cannot read %s (%s); dialling %s", self.endpoints, exc, self.address)
                moved = None
            if moved is not None and moved != self.address:
                log.warning("gateway moved: %s -> %s", self.address, moved)
                self.address = moved
        if local_link.wanted(self.local_link, self.address, self.keys):
            try:
                self._sock = LocalLink.connect(self.address, self.limits, self.gateway_timeout_s)
            except OSError as exc:  # not up yet, the link off, or an older gateway
                self._log_link(False, str(exc))
            else:
                self._log_link(True, "")
                return self._sock
        sock = make_socket(self._ctx, zmq.DEALER, sndhwm=64, rcvhwm=64)
        connect(sock, self.address, self.keys)
        self._sock = sock
        return sock

    def _log_link(self, linked: bool, why: str) -> None:
        """Say which way this worker reaches its gateway, when that changes."""
        if self._link_logged is linked:
            return
        self._link_logged = linked
        if linked:
            log.info("connected to the gateway at %s over its local link (unix socket)", self.address)
        else:
            log.info("no local link at the gateway %s (%s): dialling ZeroMQ", self.address, why)

    def _hello(self) -> dict[str, Any]:
        """Register with the gateway (retrying until it answers); return WELCOME's meta."""
        try:
            return self._register()
        except BaseException:
            if self.shm is not None:  # refused or stopped: no name may outlive this worker
                self.shm.close()
                self.shm = None
            raise

    def _register(self) -> dict[str, Any]:
        backoff = 0.2
        upgrade = local_link.wanted(self.local_link, self.address, self.keys)
        while not self.stop_event.is_set():
            sock = self._connect()
            episodes = [self.episode_id(i) for i in range(self.backend.num_envs)]
            meta = {
                "role": "worker",
                "uid": self.uid,
                "spec": self.backend.spec.to_dict(),
                "num_envs": self.backend.num_envs,
                "resume": self._last_obs_msg is not None,
                "episodes": episodes if self._last_obs_msg is not None else [],
                "pid": os.getpid(),
            }
            offer = self._offer_ring()
            if offer is not None:
                meta["shm"] = offer
            if not self._cuda_made:  # once: its buffers live as long as this worker
                self._cuda_made = True
                self.cuda = CudaRing.for_worker(self.cuda_ipc, self.address, self.backend)
            if self.cuda is not None:
                meta["cuda_ipc"] = self.cuda.offer()
            send(sock, Message(MsgType.HELLO, meta=meta))
            if sock.poll(int(self.gateway_timeout_s * 1000)):
                reply = recv(sock, self.limits)
                if reply.type is MsgType.WELCOME:
                    if upgrade and reply.meta.get("local_link") and not isinstance(sock, LocalLink):
                        # Dialled ZeroMQ before the gateway listened: register again on its link.
                        upgrade = False
                        log.info("the gateway offers its local link; registering again over it")
                        continue
                    self._ring_answered(reply.meta.get("shm"))
                    if self.cuda is not None:
                        self.cuda.answered(reply.meta.get("cuda_ipc"))
                    self._subscribe_bus(reply.meta.get("estop_bus"))
                    return reply.meta
                if reply.type is MsgType.ERROR:
                    code, text = reply.meta.get("code"), reply.meta.get("message")
                    if code in (ErrorCode.SPEC_MISMATCH.value, ErrorCode.BAD_REQUEST.value):
                        raise FatalWorkerError(f"gateway refused this worker: [{code}] {text}")
                    log.warning("gateway answered HELLO with [%s] %s; retrying", code, text)
            else:
                log.warning("no answer from gateway at %s; retrying", self.address)
            self.stop_event.wait(backoff)
            backoff = min(backoff * 2, 2.0)
        raise FatalWorkerError("stopped before the gateway answered")

    def _subscribe_bus(self, address: Any) -> None:
        """Listen to the gateway's e-stop bus at ``address`` (WELCOME's ``estop_bus``)."""
        if self._bus is not None:
            self._bus.close(linger=0)
            self._bus = None
        self._estop_epoch = 0  # epochs count per gateway process: this may be a restarted one
        if not isinstance(address, str) or not address:
            return  # an older gateway: e-stops come over the workers' socket only
        if address.startswith("tcp://"):
            host, _, port = address[len("tcp://") :].rpartition(":")
            if host in ("0.0.0.0", "*", "[::]") and self.address.startswith("tcp://"):
                host = self.address[len("tcp://") :].rpartition(":")[0]
            address = f"tcp://{host}:{port}"
        bus = make_socket(self._ctx, zmq.SUB, rcvhwm=1000)
        bus.setsockopt(zmq.SUBSCRIBE, b"")
        connect(bus, address, self.keys)
        self._bus = bus

    def _poller(self) -> zmq.Poller:
        """A poller on the gateway's socket and the e-stop bus (made again when they change)."""
        socks = (self._sock, self._bus)
        if self._polled is None or self._polled[0] != socks:
            poller = zmq.Poller()
            for sock in socks:
                if sock is not None:
                    poller.register(sock, zmq.POLLIN)
            self._polled = (socks, poller)
        return self._polled[1]

    def _bus_commands(self) -> None:
        """Apply whatever the e-stop bus has (never blocks)."""
        bus = self._bus
        while bus is not None and bus.poll(0):
            try:
                msg = recv(bus, self.limits)
            except ProtocolError as exc:
                log.warning("ignoring a malformed message on the gateway's e-stop bus: %s", exc)
                continue
            if msg.type is MsgType.COMMAND and msg.meta.get("cmd") == "estop":
                self._on_command(msg)

    def _offer_ring(self) -> dict[str, Any] | None:
        """A fresh ring for this connection attempt (the last one's name removed), if wanted."""
        if self.shm is not None:
            self.shm.close()
        spec, n = self.backend.spec, self.backend.num_envs
        self.shm = shm.ShmWriter.for_worker(
            self.shared_memory, self.address, spec.observation, n, steps.WIDTH
        )
        return self.shm.offer() if self.shm is not None else None

    def _ring_answered(self, answer: Any) -> None:
        if self.shm is not None and not self.shm.answered(answer):
            self.shm = None

    def episode_id(self, env: int) -> str:
        return episode_id(self.uid, env, int(self._episode[env]))

    # ------------------------------------------------------------------ messages

    def _obs_message(
        self,
        obs: Obs,
        *,
        reward: Any = None,
        terminated: Any = None,
        truncated: Any = None,
        info: dict[str, Any] | None = None,
        has_prev: bool,
        reset: bool = False,
    ) -> Message:
        arrays: dict[str, np.ndarray] = pack("obs", obs)
        success = (info or {}).get("success")
        step_info = steps.pack(
            episode=self._episode,
            step=self._step,
            t_capture=time.time(),
            has_prev=float(has_prev),
            reward=0.0 if reward is None else reward,
            terminated=0.0 if terminated is None else terminated,
            truncated=0.0 if truncated is None else truncated,
            success=0.0 if success is None else success,
        )
        arrays["step_info"] = step_info
        final = (info or {}).get("final_obs")
        if (
            final is not None
            and terminated is not None
            and (np.count_nonzero(terminated) or np.count_nonzero(truncated))
        ):
            arrays.update(pack("final_obs", final))
        self._seq += 1
        meta: dict[str, Any] = {"uid": self.uid, "reset": reset}
        if self.cuda is not None and self.cuda.accepted:
            # The host arrays above are still sent: the gateway records every step from them.
            step = self.cuda.write(self._seq, self.backend.device_observations())
            if step is not None:
                meta["cuda_ipc"] = step
        return Message(MsgType.OBSERVATION, seq=self._seq, meta=meta, arrays=arrays)

    def _with_prev(self, msg: Message) -> Message:
        if self._prev is None:
            return msg
        arrays = dict(msg.arrays)
        arrays.update({f"prev/{k}": v for k, v in self._prev.items()})
        return Message(msg.type, seq=msg.seq, meta=msg.meta, arrays=arrays)

    def _reset(self, seed: int | None, options: dict[str, Any] | None) -> Message:
        self._busy.enter()
        try:
            obs, _ = self.backend.reset(seed=seed, options=options)
        finally:
            self._busy.leave()
        if self._last_obs_msg is not None:
            self._episode += 1
        self._step[:] = 0
        self._prev = None
        return self._obs_message(obs, has_prev=False, reset=True)

    def _apply_action(self, obs_msg: Message, action_msg: Message) -> Message:
        action = np.asarray(action_msg.arrays["action"])
        n = self.backend.num_envs
        version = action_versions(action_msg, n)
        self._tapped = (action, version)  # what the tap shows with the observation it leads to
        old_episode, old_step = self._episode.copy(), self._step.copy()
        received = time.time()
        t_action = steps.filled(n, float(action_msg.meta.get("t_action", received)))
        started = time.perf_counter()
        self._busy.enter()
        try:
            obs, reward, terminated, truncated, info = self.backend.step(action)
        finally:
            self._busy.leave()
        step_us = (time.perf_counter() - started) * 1e6
        # Kept until the next action arrives: a restarted gateway needs it to record
        # the step this observation completes. References, not copies: the backend
        # never refills arrays it returned, and action frames are ours after receive.
        self._prev = {
            **{k: v for k, v in obs_msg.arrays.items() if k.startswith("obs/")},
            "action": action,
            "policy_version": version,
            "t_action": t_action,
            "t_capture": steps.StepInfo(obs_msg.arrays["step_info"]).t_capture.copy(),
            "episode": old_episode,
            "step": old_step,
        }
        self.env_steps += n
        done = np.asarray(terminated) | np.asarray(truncated)
        self._step += 1
        self._episode[done] += 1
        self._step[done] = 0
        msg = self._obs_message(
            obs, reward=reward, terminated=terminated, truncated=truncated, info=info, has_prev=True
        )
        hops = {"env_step": round(step_us, 1)}
        if "t_action" in action_msg.meta:
            hops["action_to_worker"] = round((received - float(action_msg.meta["t_action"])) * 1e6, 1)
        msg.meta["hops_us"] = hops
        env_log = (info or {}).get("log")
        if isinstance(env_log, dict) and env_log:
            # A simulator's episode statistics (Isaac Lab's extras["log"]), on steps with a reset.
            msg.meta["env_log"] = {
                str(k): float(v)
                for k, v in list(env_log.items())[: steps.ENV_LOG_MAX]
                if isinstance(v, (int, float))
            }
        return msg

    # ---------------------------------------------------------------------- loop

    def run(self, *, max_steps: int | None = None) -> None:
        """Serve until stopped, ``max_steps`` env steps, or a fatal refusal."""
        welcome = self._hello()
        self._busy.start()
        try:
            if self._last_obs_msg is None:
                self._last_obs_msg = self._reset(self.seed, None)
            self._serve(welcome, max_steps)
        finally:
            self._busy.close()
            if self._sock is not None:
                with contextlib.suppress(zmq.ZMQError):
                    send(self._sock, Message(MsgType.BYE, meta={"uid": self.uid}), flags=zmq.NOBLOCK)
                self._sock.close(linger=0)
                self._sock = None
            if self._bus is not None:
                self._bus.close(linger=0)
                self._bus = None
            if self.shm is not None:
                self.shm.close()
                self.shm = None
            if self.cuda is not None:
                self.cuda.close()
                self.cuda = None
            if self.tap is not None:
                self.tap.close()

    def _serve(self, welcome: dict[str, Any], max_steps: int | None) -> None:
        if welcome.get("reset_required"):
            self._last_obs_msg = self._reset(self.seed, None)
        assert self._sock is not None and self._last_obs_msg is not None
        outgoing = self._with_prev(self._last_obs_msg) if self.reconnects else self._last_obs_msg
        while not self.stop_event.is_set():
            if max_steps is not None and self.env_steps >= max_steps:
                return
            sent_at = time.perf_counter()
            send(self._sock, self.shm.encode(outgoing) if self.shm is not None else outgoing)
            if self.tap is not None:  # after the gateway has it: watchers never delay a step
                self.tap.publish(outgoing, *self._tapped)
            reply = self._await_reply(outgoing.seq)
            if self.stop_event.is_set():
                return
            if reply is None:  # gateway silent: reconnect and resend with prev attached
                self.reconnects += 1
                welcome = self._hello()
                self._replay()
                if welcome.get("reset_required"):
                    self._last_obs_msg = self._reset(self.seed, None)
                    outgoing = self._last_obs_msg
                else:
                    outgoing = self._with_prev(self._last_obs_msg)
                continue
            if reply.type is MsgType.ACTION:
                self._rtt_us = (time.perf_counter() - sent_at) * 1e6
                self._settle(reply)
                problems = (
                    self.backend.spec.check_action(
                        np.asarray(reply.arrays.get("action")), self.backend.num_envs
                    )
                    if "action" in reply.arrays
                    else ["no action array"]
                )
                if problems:
                    raise ProtocolError(
                        ErrorCode.BAD_REQUEST, f"gateway sent a bad action: {'; '.join(problems)}"
                    )
                nxt = self._apply_action(self._last_obs_msg, reply)
            elif reply.type is MsgType.RESET:
                self._settle(reply)
                nxt = self._reset(reply.meta.get("seed"), reply.meta.get("options"))
            else:  # COMMAND stop
                return
            nxt.meta["rtt_us"] = round(self._rtt_us, 1)
            if reply.type is not MsgType.ACTION:  # _apply_action keeps the action it applied
                self._tapped = (None, None)
            self._last_obs_msg = nxt
            outgoing = nxt

    def _settle(self, reply: Message) -> None:
        """Keep the steps the answer to the last observation does not acknowledge yet."""
        assert self._last_obs_msg is not None
        seq = self._last_obs_msg.seq
        acked = reply.meta.get("acked", 0)
        self.acked_steps += acked if isinstance(acked, int) else 0
        through = reply.meta.get("through")
        if not isinstance(through, int) or isinstance(through, bool):
            through = seq  # a gateway that writes every step before it answers
        self._unacked = [m for m in self._unacked if m.seq > through]
        if seq > through and self._prev is not None:
            self._unacked.append(self._with_prev(self._last_obs_msg))

    def _replay(self) -> None:
        """Send the steps no answer acknowledged to the gateway just (re)joined, oldest
        first and before anything else: one that died before writing them records them."""
        assert self._sock is not None
        for kept in self._unacked:
            replay = Message(kept.type, seq=kept.seq, meta={**kept.meta, "replay": True}, arrays=kept.arrays)
            send(self._sock, self.shm.encode(replay) if self.shm is not None else replay)
        if self._unacked:
            log.info("sent %d unacknowledged step(s) again to the gateway", len(self._unacked))

    def _await_reply(self, seq: int) -> Message | None:
        """The gateway's answer to observation ``seq``; None when it went silent."""
        assert self._sock is not None
        last_heard = time.monotonic()
        poller = self._poller()
        while not self.stop_event.is_set():
            link = self._sock if isinstance(self._sock, LocalLink) else None
            events = local_link.poll(poller, int(self.heartbeat_s * 1000), link)
            if link is not None and link.closed:
                log.warning("the gateway closed the local link; reconnecting")
                return None
            if self._bus is not None and self._bus in events:
                self._bus_commands()
                if self.stop_event.is_set():
                    return None
                if self._sock not in events:
                    continue
            if self._sock not in events:
                if time.monotonic() - last_heard > self.gateway_timeout_s:
                    log.warning("gateway silent for %.1f s; reconnecting", time.monotonic() - last_heard)
                    return None
                send(self._sock, Message(MsgType.HEARTBEAT, meta={"uid": self.uid, "waiting": seq}))
                continue
            msg = recv(self._sock, self.limits)
            last_heard = time.monotonic()
            if msg.type is MsgType.HEARTBEAT:
                continue
            if msg.type is MsgType.ERROR:
                code, text = msg.meta.get("code"), msg.meta.get("message")
                if code == ErrorCode.NOT_REGISTERED.value:
                    log.warning("gateway does not know this worker (restarted?); registering again")
                    return None
                raise FatalWorkerError(f"gateway error: [{code}] {text}")
            if msg.type in (MsgType.ACTION, MsgType.RESET) and msg.seq == seq:
                return msg
            if msg.type is MsgType.COMMAND:
                self._on_command(msg)
                if self.stop_event.is_set():
                    return msg
                continue
            log.debug("ignoring %s seq %d while waiting for %d", msg.type.name, msg.seq, seq)
        return None

    def _on_command(self, msg: Message) -> None:
        """A COMMAND the gateway sent: ``estop``, ``stop``, or an operator command for the backend."""
        cmd = msg.meta.get("cmd")
        if cmd == "estop":
            epoch = msg.meta.get("epoch")
            if isinstance(epoch, int) and not isinstance(epoch, bool):
                if epoch <= self._estop_epoch:
                    return  # had it from the bus (or the socket) already, or superseded
                self._estop_epoch = epoch
            engaged = bool(msg.meta.get("engaged", True))
            self.backend.estop(engaged)
            log.warning(
                "e-stop %s by the gateway (%s)",
                "engaged" if engaged else "released",
                msg.meta.get("reason", ""),
            )
        elif cmd == "stop":
            self.stop_event.set()
        elif isinstance(cmd, str) and not self.backend.command(cmd, msg.meta):
            log.info("command %r from the gateway does not apply to this backend", cmd)

    def _keepalive(self) -> bool:
        """The backend's ``keepalive``: heartbeat and take commands while it blocks in a step or reset.

        Runs on the worker's own thread (the backend calls it), so the socket is never
        shared. Replies cannot arrive here (no observation is outstanding while the
        backend runs); anything but a COMMAND is what :meth:`_await_reply` ignores too.
        """
        sock = self._sock
        if sock is None:
            return not self.stop_event.is_set()
        self._bus_commands()
        with self._busy.lock:  # its thread sends heartbeats on this socket too
            self._busy_heartbeat()
            while sock.poll(0):
                msg = recv(sock, self.limits)
                if msg.type is MsgType.COMMAND:
                    self._on_command(msg)
        return not self.stop_event.is_set()

    def _busy_heartbeat(self) -> None:
        """A heartbeat saying the backend is busy, at most one per ``heartbeat_s``; with
        :attr:`_busy`'s lock held (:mod:`gateway.worker.busy`)."""
        now = time.monotonic()
        if self._sock is not None and now - self._last_beat >= self.heartbeat_s:
            send(self._sock, Message(MsgType.HEARTBEAT, meta={"uid": self.uid, "busy": True}))
            self._last_beat = now
