"""The gateway's client socket: :mod:`gateway.client` envs driving workers directly.

A client attaches to one worker (HELLO ``{"role": "client", "num_envs": n}``, optionally
naming the worker's ``uid``) and from then on that worker's observations go to the
client instead of the policy; the client's RESET and STEP messages become the worker's
resets and actions. Everything the worker does is still recorded like any other step
(policy version: the client's ``version``, default 0); the steps a client attached with
``takeover: true`` drives are flagged ``intervention`` (the console's teleoperation is
one), so they also reach the replay service's ``interventions`` tables; a STEP's meta
``intervention`` (one bool per env) says which envs a person drove, for any client.

When the experiment's policy drives the workers (``policy.kind`` other than
``external``), attaching needs ``takeover: true`` in the HELLO: the policy gets the
worker back when the client says BYE or falls silent and another client needs it.

The gateway's stop states hold clients as they hold the policy: while the e-stop is
engaged, collection is paused, the step budget is reached or the sink pushes back, a
client's RESET or STEP waits at the gateway (the worker's envs do not move) and the
client is sent HELD ``{reason, message}`` about once a second; the request goes ahead
once the state lifts. While the run drains (it is ending) the request is answered with
the error ``run_ended``.

A HELLO that arrives before any worker has registered (a script started with ``loopgate
up``, or while every worker restarts) waits the same way, with HELD ``{reason:
"no_worker"}`` about once a second, and is answered once a worker registers. With
workers registered, a HELLO that none of them can take is refused at once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from gateway.hub.state import Hub, WorkerSession
from gateway.protocol import ErrorCode, Message, MsgType, ProtocolError, error_message, recv_routed, send
from gateway.transport import CurveKeys, bind, make_socket

log = logging.getLogger(__name__)


@dataclass
class ClientState:
    route: bytes
    uid: str
    last_seen: float
    waiting_seq: int | None = None
    """Seq of the client's RESET or STEP waiting for an observation."""
    reset_request: tuple[Any, Any] | None = None
    """A reset asked for while the worker was busy: (seed, options)."""
    version: int = 0
    takeover: bool = False
    """Attached with ``takeover: true``: its steps are interventions."""
    held: Message | None = None
    """A RESET or STEP that a stop state holds back (see :meth:`ClientRouter.release_held`)."""
    held_notice: float = 0.0
    """When the client was last told that its request is held (monotonic)."""


HELD_NOTICE_S = 1.0
"""How often a client with a held request hears why (it resets the client's deadline)."""


class ClientRouter:
    """Attaches clients to workers and relays their resets, steps and observations."""

    def __init__(self, hub: Hub, ctx: zmq.Context[Any], address: str, keys: CurveKeys | None) -> None:
        self.hub = hub
        self.sock = make_socket(ctx, zmq.ROUTER)
        self.address = bind(self.sock, address, keys)
        self.clients: dict[bytes, ClientState] = {}
        self.waiting: dict[bytes, tuple[Message, float]] = {}
        """HELLOs that wait for a first worker: route -> (HELLO, when last told so)."""

    def _session(self, state: ClientState) -> WorkerSession:
        session = self.hub.sessions.get(state.uid)
        if session is None or session.client != state.route:
            self.clients.pop(state.route, None)
            raise ProtocolError(ErrorCode.UNAVAILABLE, f"worker {state.uid} is gone; attach again with HELLO")
        return session

    def on_message(self) -> None:
        route, msg, err = recv_routed(self.sock, self.hub.limits)
        if err is not None:
            self.hub.reply_error(self.sock, route, err)
            return
        assert msg is not None
        try:
            if msg.type is MsgType.HELLO:
                self.on_hello(route, msg)
                return
            state = self.clients.get(route)
            if state is None:
                if msg.type is MsgType.BYE:
                    self.waiting.pop(route, None)  # a client that gave up waiting
                    return
                raise ProtocolError(ErrorCode.NOT_REGISTERED, f"send HELLO before {msg.type.name}")
            state.last_seen = time.monotonic()
            if msg.type in (MsgType.RESET, MsgType.STEP):
                self.on_request(state, msg)
            elif msg.type is MsgType.HEARTBEAT:
                send(self.sock, Message(MsgType.HEARTBEAT, seq=msg.seq), route=[route])
            elif msg.type is MsgType.BYE:
                self.detach(state)
            else:
                raise ProtocolError(
                    ErrorCode.UNEXPECTED, f"{msg.type.name} is not accepted on the client socket"
                )
        except ProtocolError as exc:
            self.hub.reply_error(self.sock, route, exc, msg.seq)

    def on_hello(self, route: bytes, msg: Message) -> None:
        num_envs, wanted = msg.meta.get("num_envs"), msg.meta.get("worker")
        takeover = bool(msg.meta.get("takeover", False))
        if self.hub.policy_drives and not takeover:
            raise ProtocolError(
                ErrorCode.UNAVAILABLE,
                "the experiment's policy drives every worker; set policy.kind: external, or attach with takeover",
            )
        if route in self.clients:
            self.detach(self.clients[route])
        now = time.monotonic()
        self.waiting.pop(route, None)
        if not self.hub.sessions:
            if self.hub.hold_reason(policy=False) == "draining":
                raise ProtocolError(ErrorCode.RUN_ENDED, self.hub.hold_message("draining"))
            log.info("client %s waits for a worker to register", route.hex()[:8])
            self._notify_waiting(route, msg, now)
            return
        candidates = [
            s
            for s in self.hub.sessions.values()
            if (wanted is None or s.uid == wanted) and (num_envs is None or s.num_envs == num_envs)
        ]
        free = [s for s in candidates if s.client is None]
        if not free:
            # A client that fell silent gives way to one that is here.
            stale = [s for s in candidates if s.client is not None and self._silent(s.client, now)]
            for s in stale:
                assert s.client is not None
                self.detach(self.clients[s.client])
            free = stale
        if not free:
            known = ", ".join(
                f"{s.uid} ({s.num_envs} envs{', taken' if s.client else ''})"
                for s in self.hub.sessions.values()
            )
            raise ProtocolError(
                ErrorCode.UNAVAILABLE,
                f"no free worker with num_envs={num_envs}{f' and uid={wanted}' if wanted else ''}; workers: {known or 'none'}",
            )
        session = free[0]
        session.client = route
        self.clients[route] = ClientState(
            route, session.uid, now, version=int(msg.meta.get("version", 0)), takeover=takeover
        )
        assert self.hub.spec is not None
        meta = {"worker": session.uid, "num_envs": session.num_envs, "spec": self.hub.spec.to_dict()}
        send(self.sock, Message(MsgType.WELCOME, seq=msg.seq, meta=meta), route=[route])
        log.info("client %s attached to worker %s", route.hex()[:8], session.uid)

    def _notify_waiting(self, route: bytes, hello: Message, now: float) -> None:
        self.waiting[route] = (hello, now)
        meta = {"reason": "no_worker", "message": "no env worker has registered with the gateway yet"}
        send(self.sock, Message(MsgType.HELD, seq=hello.seq, meta=meta), route=[route])

    def _attach_waiting(self, now: float) -> None:
        """HELLOs that waited for a first worker: answered once one registered (or the run
        ends), reminded once a second meanwhile."""
        draining = self.hub.hold_reason(policy=False) == "draining"
        for route, (hello, told) in list(self.waiting.items()):
            if self.hub.sessions or draining:
                del self.waiting[route]
                try:
                    if draining:
                        raise ProtocolError(ErrorCode.RUN_ENDED, self.hub.hold_message("draining"))
                    self.on_hello(route, hello)
                except ProtocolError as exc:
                    self.hub.reply_error(self.sock, route, exc, hello.seq)
            elif now - told >= HELD_NOTICE_S:
                self._notify_waiting(route, hello, now)

    def _silent(self, route: bytes, now: float) -> bool:
        state = self.clients.get(route)
        return state is None or now - state.last_seen > self.hub.worker_timeout_s

    def on_request(self, state: ClientState, msg: Message) -> None:
        """A RESET or STEP: hold it while a stop state lasts, else pass it on."""
        if state.held is not None:
            raise ProtocolError(
                ErrorCode.UNEXPECTED, "the previous reset or step is still held; wait for its answer"
            )
        reason = self.hub.hold_reason(policy=False)
        if reason == "draining":
            raise ProtocolError(ErrorCode.RUN_ENDED, self.hub.hold_message(reason))
        if reason is not None:
            self._session(state)  # a client of a worker that is gone hears so at once
            if msg.type is MsgType.STEP:
                self._check_step(state, msg)  # a bad action is refused now, not after the hold
            state.held = msg
            self._notify_held(state, reason, time.monotonic())
            return
        if msg.type is MsgType.RESET:
            self.on_reset(state, msg)
        else:
            self.on_step(state, msg)

    def _notify_held(self, state: ClientState, reason: str, now: float) -> None:
        assert state.held is not None
        state.held_notice = now
        meta = {"reason": reason, "message": self.hub.hold_message(reason)}
        send(self.sock, Message(MsgType.HELD, seq=state.held.seq, meta=meta), route=[state.route])

    def release_held(self) -> None:
        """Go ahead with held requests whose stop state lifted; tell the others why they wait."""
        now = time.monotonic()
        if self.waiting:
            self._attach_waiting(now)
        reason = self.hub.hold_reason(policy=False)
        for state in [s for s in self.clients.values() if s.held is not None]:
            msg = state.held
            assert msg is not None
            try:
                if reason == "draining":
                    state.held = None
                    raise ProtocolError(ErrorCode.RUN_ENDED, self.hub.hold_message(reason))
                if reason is not None:
                    if now - state.held_notice >= HELD_NOTICE_S:
                        self._notify_held(state, reason, now)
                    continue
                state.held = None
                if msg.type is MsgType.RESET:
                    self.on_reset(state, msg)
                else:
                    self.on_step(state, msg)
            except ProtocolError as exc:
                self.hub.reply_error(self.sock, state.route, exc, msg.seq)

    def on_reset(self, state: ClientState, msg: Message) -> None:
        session = self._session(state)
        seed, options = msg.meta.get("seed"), msg.meta.get("options")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"seed must be an integer or null, got {seed!r}")
        state.waiting_seq = msg.seq
        if session.awaiting is not None and not session.submitted:
            self.hub.send_reset(session, seed, options)
        else:
            state.reset_request = (seed, options)

    def _check_step(self, state: ClientState, msg: Message) -> np.ndarray:
        """The STEP's action, checked against the spec and the worker's env count."""
        session = self._session(state)
        action = msg.arrays.get("action")
        if action is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "STEP needs an 'action' array")
        assert self.hub.spec is not None
        problems = self.hub.spec.check_action(np.asarray(action), session.num_envs)
        if problems:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "action: " + "; ".join(problems))
        return np.asarray(action)

    def on_step(self, state: ClientState, msg: Message) -> None:
        session = self._session(state)
        if session.awaiting is None or state.reset_request is not None:
            raise ProtocolError(
                ErrorCode.UNEXPECTED, "the previous reset or step is still running; wait for its answer"
            )
        action = self._check_step(state, msg)
        driven = self._interventions(msg, session.num_envs, state.takeover)
        versions = self._versions(msg, session.num_envs, state.version)
        state.waiting_seq = msg.seq
        if driven is not None:
            session.takeover_seq, session.takeover_envs = session.awaiting, driven
        self.hub.send_action(session, session.awaiting, np.array(action), versions)

    @staticmethod
    def _versions(msg: Message, num_envs: int, version: int) -> np.ndarray:
        """The STEP's ``policy_version`` array (i64 per env: a client acting partly with a
        policy says whose weights chose each env's action), else its attach-time version."""
        given = msg.arrays.get("policy_version")
        if given is None:
            return np.full(num_envs, version, dtype=np.int64)
        if given.dtype != np.int64 or given.shape != (num_envs,):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"STEP policy_version must be int64[{num_envs}], got {given.dtype}{list(given.shape)}",
            )
        return np.array(given)

    @staticmethod
    def _interventions(msg: Message, num_envs: int, takeover: bool) -> np.ndarray | None:
        """Which envs of a STEP a person drives: its meta ``intervention`` (one bool per
        env), else every env for a takeover client; None: none."""
        given = msg.meta.get("intervention")
        if given is None:
            return np.ones(num_envs, bool) if takeover else None
        if (
            not isinstance(given, list)
            or len(given) != num_envs
            or not all(isinstance(g, bool) for g in given)
        ):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"STEP meta intervention must be a list of {num_envs} booleans, got {given!r}",
            )
        return np.asarray(given, bool)

    def forward_observation(self, session: WorkerSession, msg: Message) -> None:
        assert session.client is not None
        state = self.clients.get(session.client)
        if state is None:
            return
        if state.reset_request is not None:
            seed, options = state.reset_request
            state.reset_request = None
            self.hub.send_reset(session, seed, options)
            return
        if state.waiting_seq is None:
            return  # nobody asked; the observation waits in the session until they do
        arrays = {k: v for k, v in msg.arrays.items() if not k.startswith("prev/")}
        meta = {"worker": session.uid, "reset": bool(msg.meta.get("reset", False))}
        send(
            self.sock,
            Message(MsgType.OBSERVATION, seq=state.waiting_seq, meta=meta, arrays=arrays),
            route=[state.route],
        )
        state.waiting_seq = None

    def detach(self, state: ClientState) -> None:
        self.clients.pop(state.route, None)
        session = self.hub.sessions.get(state.uid)
        if session is not None and session.client == state.route:
            session.client = None
            log.info("client %s detached from worker %s", state.route.hex()[:8], state.uid)

    def worker_gone(self, session: WorkerSession) -> None:
        if session.client is None:
            return
        state = self.clients.pop(session.client, None)
        if state is not None and state.waiting_seq is not None:
            send(
                self.sock,
                error_message(
                    ErrorCode.UNAVAILABLE.value, f"worker {session.uid} is gone", state.waiting_seq
                ),
                route=[state.route],
            )

    def close(self) -> None:
        self.sock.close(linger=0)
