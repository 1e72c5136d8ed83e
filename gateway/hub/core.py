"""The gateway's loop: routes observations to the policy and actions back, and records.

One single-threaded event loop over ZeroMQ sockets, the control socket first in every
turn and between worker messages (an e-stop never queues behind observations):

- ``workers`` (ROUTER): env workers register (HELLO with their spec; a mismatch is
  refused with ``spec_mismatch``: :mod:`gateway.hub.registration`), send OBSERVATION
  batches and get ACTIONs; workers on this host reach it over unix sockets beside it
  (:mod:`gateway.local_link`);
- ``clients`` (ROUTER): :mod:`gateway.client` envs attach to a worker and drive it
  (RESET / STEP) instead of the policy;
- ``control`` (ROUTER): COMMANDs from the CLI, the supervisor and the trainer (status,
  pause, resume, estop, ready, drain, shutdown; :mod:`gateway.hub.control`);
- the action source's and the trajectory sink's own sockets.

Every transition a worker reports is written to the recorder's spool before an answer
acknowledges it (``meta["acked"]``, ``meta["through"]``; an in-process policy's ACTION
leaves first and the next one acknowledges: :mod:`gateway.hub.durability`). A malformed
message is answered with an ERROR naming the problem, counted, logged once per peer and
code, and the loop goes on serving everyone else. A worker silent for
``worker_timeout_s`` has its episodes closed as interrupted (their steps kept). Worker sessions and the collection state
(pause, e-stop, budget, draining) are in :mod:`gateway.hub.state`; the process entry
point (``python -m gateway.hub``) is :mod:`gateway.hub.__main__`.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from gateway import local_link
from gateway.config import GatewayConfig
from gateway.endpoints import EndpointsFollower, follow_all
from gateway.episode import EnvSpec, non_finite
from gateway.evaluation import Evaluator, LagTracker
from gateway.hub import durability, registration
from gateway.hub.accounting import account
from gateway.hub.clients import ClientRouter
from gateway.hub.control import ControlDesk
from gateway.hub.state import HOLD_MESSAGES, Collection, WorkerSession
from gateway.hub.status import status_of
from gateway.hub.timing import StepTiming
from gateway.local_link import WorkerSockets
from gateway.metrics import Histogram, MetricsWriter
from gateway.policies import ActionSource
from gateway.protocol import (
    ErrorCode,
    Limits,
    Message,
    MsgType,
    ProtocolError,
    error_message,
    recv_routed,
    send,
)
from gateway.protocol.codec import FrameSocket
from gateway.recorder import Recorder
from gateway.transport import CurveKeys, bind, make_socket, readable

log = logging.getLogger(__name__)

TICK_S = 0.05


NO_ACTION_LOG_S = 10.0
"""A worker the policy keeps failing is logged at most this often (with the count)."""


class Gateway:
    """The hub; construct with bound sockets' addresses, then :meth:`run`."""

    def __init__(
        self,
        *,
        config: GatewayConfig,
        source: ActionSource | None,
        recorder: Recorder,
        spec: EnvSpec | None = None,
        addresses: dict[str, str],
        keys: CurveKeys | None = None,
        metrics: MetricsWriter | None = None,
        trace: MetricsWriter | None = None,
        max_env_steps: int | None = None,
        context: zmq.Context[Any] | None = None,
        endpoints: EndpointsFollower | None = None,
        realtime_priority: int = 0,
        estop_latch: Path | None = None,
    ) -> None:
        self.config = config
        self.endpoints = endpoints
        """The run's ``endpoints.json``, followed: an inference server or the replay service
        restarted at another address is dialled there (:mod:`gateway.endpoints`)."""
        self.source = source
        self.recorder = recorder
        self.spec = spec
        self.limits: Limits = config.limits
        self.metrics = metrics or MetricsWriter(None, "gateway")
        self.timing = StepTiming(recorder.ack_latency, trace)
        self.busy_s = 0.0
        """Time the loop spent serving (not waiting in poll): the gateway's busy time."""
        self._ctx = context or zmq.Context.instance()
        router = make_socket(self._ctx, zmq.ROUTER, sndhwm=10_000, rcvhwm=10_000)
        router.router_mandatory = False
        self.addresses = {"workers": bind(router, addresses["workers"], keys)}
        # Workers on this host get a unix socket beside the ROUTER (gateway.local_link).
        self.workers_sock = WorkerSockets.offer(
            router, self.addresses["workers"], config.local_link, keys, self.limits
        )
        self.state = Collection(max_env_steps=max_env_steps, env_steps=recorder.counters.acked_steps)
        self.sessions: dict[str, WorkerSession] = {}
        self.realtime_priority = realtime_priority
        """``run.realtime_priority``: the process's real-time priority, taken by ``main`` (0: normal)."""
        self.control = ControlDesk(self, self._ctx, addresses["control"], keys, estop_latch)
        self.addresses["control"] = self.control.address
        self.clients = ClientRouter(self, self._ctx, addresses["clients"], keys)
        self.addresses["clients"] = self.clients.address
        self.by_route: dict[bytes, str] = {}
        self.errors: Counter[str] = Counter()
        self._logged: set[tuple[bytes, str]] = set()
        self.rtt = Histogram()
        self.worker_timeout_s = config.worker_timeout_s
        self.policy_drives = source is not None
        self.started = time.monotonic()
        self._rate: deque[tuple[float, int]] = deque(maxlen=64)
        self._orphans_deadline = time.monotonic() + config.worker_timeout_s
        self.evaluator = Evaluator()
        if spec is not None:
            self.evaluator.success_signal = bool(spec.metadata.get("success_signal", True))
        self.lag = LagTracker()

    # ----------------------------------------------------------------- helpers

    def reply_error(self, sock: FrameSocket, route: bytes, exc: ProtocolError, seq: int = 0) -> None:
        self.errors[exc.code.value] += 1
        if (route, exc.code.value) not in self._logged:
            self._logged.add((route, exc.code.value))
            log.warning(
                "peer %s: %s (further %s errors from it are counted, not logged)",
                route.hex()[:8],
                exc,
                exc.code.value,
            )
        send(sock, error_message(exc.code.value, exc.message, seq), route=[route])

    def hold_reason(self, *, policy: bool = True, session: WorkerSession | None = None) -> str | None:
        """Why no step may be taken now (see :meth:`Collection.hold_reason`), or None; the
        policy lag bound applies to the experiment's own policy (``policy``) only. With
        ``session``, for that worker: an evaluation round lifts backpressure only for the
        workers it needs (:meth:`Evaluator.lifts_hold`)."""
        return self.state.hold_reason(
            sink_blocked=self.recorder.sink.blocked,
            lag_exceeded=policy and self.lag_exceeded,
            evaluating=self.evaluator.lifts_hold(None if session is None else session.uid),
            spool_failing=self.recorder.spool_error is not None,
        )

    def hold_message(self, reason: str) -> str:
        """What a held peer is told, in words a person can act on."""
        return HOLD_MESSAGES[reason].format(
            budget=self.state.max_env_steps,
            sink=self.recorder.sink.describe(),
            spool=self.recorder.spool_error,
        )

    def collecting_for(self, session: WorkerSession) -> bool:
        """Whether ``session``'s worker may step now, for the experiment's policy."""
        return self.hold_reason(session=session) is None

    @property
    def lag_exceeded(self) -> bool:
        return self.source is not None and self.lag.exceeded(self.source.version)

    # ----------------------------------------------------------------- workers

    def on_worker_message(self) -> None:
        route, msg, err = recv_routed(self.workers_sock, self.limits)
        if err is not None:
            self.reply_error(self.workers_sock, route, err)
            return
        assert msg is not None
        try:
            if msg.type is MsgType.HELLO:
                registration.register(self, route, msg)
                return
            uid = self.by_route.get(route)
            session = self.sessions.get(uid) if uid else None
            if session is None:
                if msg.type is MsgType.BYE:
                    return
                raise ProtocolError(ErrorCode.NOT_REGISTERED, f"send HELLO before {msg.type.name}")
            session.last_seen = time.monotonic()
            if msg.type is MsgType.OBSERVATION:
                self.on_observation(session, session.receive(msg))
            elif msg.type is MsgType.HEARTBEAT:
                send(self.workers_sock, Message(MsgType.HEARTBEAT), route=[route])
            elif msg.type is MsgType.BYE:
                self.drop_worker(session, "said goodbye")
            else:
                raise ProtocolError(
                    ErrorCode.UNEXPECTED, f"{msg.type.name} is not accepted on the worker socket"
                )
        except ProtocolError as exc:
            self.reply_error(self.workers_sock, route, exc, msg.seq)

    def on_observation(self, session: WorkerSession, msg: Message) -> None:
        if session.unspooled:  # an earlier one waits for the disk: this one waits behind it
            session.unspooled.append(msg)
            return
        if msg.meta.get("replay"):
            durability.replay(self, session, msg)
            return
        if msg.seq <= session.last_seq:
            # A resend of an observation we already handled (the worker reconnected):
            # answer it again if we answered before; otherwise its answer is pending.
            if msg.seq == session.last_seq and session.last_reply is not None:
                send(self.workers_sock, session.last_reply, route=[session.route])
            elif msg.seq == session.last_seq:
                session.awaiting = msg.seq
            return
        if not durability.flush_unwritten(self, session):
            session.unspooled.append(msg)
            return
        t_received = time.time()
        assert self.spec is not None  # set by the first HELLO
        obs, info = registration.check_observation(self.spec, session, msg)
        session.device_obs = session.device_handle(msg)
        self.timing.observation(session, msg, info, t_received)
        if session.held:
            session.held = False
        elif msg.meta.get("rtt_us"):
            session.rtt_us = float(msg.meta["rtt_us"])
            self.rtt.add(session.rtt_us)
        # Once draining, every episode has been flushed: a step completed now (by an action
        # sent before the drain) could not reach the store, so it is neither recorded nor
        # acknowledged, like one completed in an episode the drain closed.
        rows = info.has_prev.nonzero()[0] if not self.state.draining else np.empty(0, np.int64)
        completed = session.completed(msg, info, rows) if len(rows) else None
        if completed is None:  # nothing to write: its answer acknowledges it
            session.through = msg.seq
        old_episodes = session.pending_ids[0] if session.pending_ids is not None else None
        before = session.answer_state()
        session.last_seq = msg.seq
        session.last_reply = None
        session.pending_obs = obs
        session.pending_ids = (info.episode, info.step, info.t_capture)
        session.awaiting = msg.seq
        session.submitted = False
        session.t_received = t_received
        # The order of answer and write (gateway.hub.durability): an in-process policy's
        # ACTION leaves first and acknowledges these steps with the next one; an inference
        # server computes while they are written; a client or a held observation gets them
        # only once they are written.
        order = durability.order(self, session) if completed is not None else "write"
        if order != "write":  # collecting, for the experiment's policy: ask it now
            self._submit(session)
        written = 0
        if completed is not None:
            done = durability.write(
                self, session, msg, info, completed, old_episodes, answered=order == "act", before=before
            )
            if done is None:
                return
            written = done
        if order == "write":
            self.route_observation(session, msg)
        # Bookkeeping (chunking, episode ends, evaluation, lag) after the ACTION left
        # (in-process policies answer at once) or while the policy computes it.
        account(self, session, msg, info, completed, old_episodes, written)

    def note_rate(self) -> None:
        self._rate.append((time.monotonic(), self.state.env_steps))

    def steps_per_s(self, now: float) -> float:
        """Env steps per second over the recent window (0 when collection stalled)."""
        if len(self._rate) >= 2:
            (t0, s0), (t1, s1) = self._rate[0], self._rate[-1]
            if now - t1 < 2.0 and t1 > t0:
                return (s1 - s0) / (t1 - t0)
        return 0.0

    def route_observation(self, session: WorkerSession, msg: Message) -> None:
        """To a client, the action source, or held."""
        if session.client is not None:
            self.clients.forward_observation(session, msg)
        elif self.source is not None and self.collecting_for(session):
            self._submit(session)
        else:
            session.held = True  # answered when collection resumes

    def _submit(self, session: WorkerSession) -> None:
        assert self.source is not None and session.pending_obs is not None and session.awaiting is not None
        session.submitted = True
        session.t_submitted = time.perf_counter()
        key, deadline = (session.uid, session.awaiting), time.monotonic() + self.config.action_deadline_s
        flags = self.evaluator.flags(session.uid, session.num_envs)
        device: dict[str, Any] = {} if session.device_obs is None else {"device_obs": session.device_obs}
        if np.count_nonzero(flags):  # evaluation episodes act deterministically
            self.source.submit(key, session.pending_obs, deadline, deterministic=flags.copy(), **device)
        else:
            self.source.submit(key, session.pending_obs, deadline, **device)
        if self.source.synchronous:  # answered already: send it now, not at the end of the loop
            self.collect_actions()

    def send_action(
        self,
        session: WorkerSession,
        seq: int,
        actions: np.ndarray,
        versions: np.ndarray,
        started: float | None = None,
    ) -> None:
        if session.awaiting != seq:
            return  # the worker moved on (reconnect, reset) meanwhile
        assert self.spec is not None
        problems = self.spec.check_action(np.asarray(actions), session.num_envs)
        if problems:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "action: " + "; ".join(problems))
        session.action = np.asarray(actions)
        session.versions = np.asarray(versions, dtype=np.int64)
        session.t_action = time.time()
        self.timing.action(session, seq)
        meta: dict[str, Any] = {"acked": session.acked_now, "through": session.through}
        meta["t_action"] = session.t_action
        session.acked_now = 0
        arrays = {"action": session.action}
        v = session.versions
        if len(v) and not np.count_nonzero(v != v[0]):
            meta["version"] = int(v[0])  # one frame less on every step
        else:
            arrays["policy_version"] = v
        reply = Message(MsgType.ACTION, seq=seq, meta=meta, arrays=arrays)
        send(self.workers_sock, reply, route=[session.route])
        session.last_reply = reply
        session.awaiting = None
        session.submitted = False

    def send_reset(self, session: WorkerSession, seed: int | None, options: dict[str, Any] | None) -> None:
        assert session.awaiting is not None
        meta = {"seed": seed, "options": options, "acked": session.acked_now, "through": session.through}
        session.acked_now = 0
        reply = Message(MsgType.RESET, seq=session.awaiting, meta=meta)
        send(self.workers_sock, reply, route=[session.route])
        session.last_reply = reply
        session.awaiting = None

    def collect_actions(self) -> None:
        if self.source is None:
            return
        for (uid, seq), actions, versions, error in self.source.results():
            session = self.sessions.get(uid)
            if session is None:
                continue
            if error is not None or actions is None or versions is None:
                # A refusal (not a server that is down or late) of an observation with NaN.
                if "[bad_request]" in str(error) and self.refuse_non_finite(session, seq, str(error)):
                    continue
                session.no_action += 1
                if session.no_action == 1 or time.monotonic() - session.no_action_logged > NO_ACTION_LOG_S:
                    session.no_action_logged = time.monotonic()
                    log.warning(
                        "no action for worker %s (%d time(s) for this observation): %s; asking again",
                        uid,
                        session.no_action,
                        error,
                    )
                session.submitted = False
                continue
            session.no_action = 0
            try:
                self.send_action(session, seq, actions, versions)
            except ProtocolError as exc:
                if self.refuse_non_finite(session, seq, str(exc)):
                    continue
                log.error("policy produced a bad action for worker %s: %s", uid, exc)
                raise

    def refuse_non_finite(self, session: WorkerSession, seq: int, error: str) -> bool:
        """When the policy could not act on an observation holding NaN or Inf, refuse the
        observation (its worker ends, saying why) rather than ask again forever: the same
        observation gives the same answer. Whether it does is only looked at here, after a
        failure, so a camera's NaN pixels cost nothing while the policy copes with them."""
        bad = non_finite(session.pending_obs) if session.pending_obs is not None else None
        if bad is None or session.awaiting != seq:
            return False
        why = (
            f"the observation holds NaN or Inf ({bad}) and the policy cannot act on it ({error}): "
            "the env, or a sensor, produced it"
        )
        log.error("worker %s: %s", session.uid, why)
        send(self.workers_sock, error_message(ErrorCode.BAD_REQUEST.value, why, seq), route=[session.route])
        session.awaiting, session.submitted = None, False
        return True

    def drop_worker(self, session: WorkerSession, why: str) -> None:
        interrupted = self.recorder.interrupt(session.uid)
        log.warning("worker %s %s; %d episode(s) closed as interrupted", session.uid, why, interrupted)
        self.evaluator.forget(session.uid)
        self.sessions.pop(session.uid, None)
        self.by_route.pop(session.route, None)
        self.clients.worker_gone(session)

    # ----------------------------------------------------------------- control

    def status(self) -> dict[str, Any]:
        return status_of(self)

    def send_to_workers(self, msg: Message, sessions: list[WorkerSession] | None = None) -> None:
        """``msg`` (a COMMAND) to every registered worker, or to ``sessions``."""
        for session in self.sessions.values() if sessions is None else sessions:
            send(self.workers_sock, msg, route=[session.route])

    def begin_drain(self) -> None:
        """The run ends: close open episodes, hand everything to the sink, record no more."""
        if not self.state.draining:
            log.info("draining: closing open episodes and waiting for the sink to store them")
        self.state.draining = True
        self.recorder.drain()
        self.clients.release_held()  # held clients hear that the run ends

    def flush_open(self) -> dict[str, Any]:
        """Cut every open episode's held steps into chunks now (``flush``: the end of an
        on-policy round). The observation a held worker waits in goes with each chunk as
        its last step's next observation; ``acting_workers`` counts the workers whose
        action is out, whose steps of it are recorded only when they answer."""
        next_obs = {
            uid: s.pending_obs
            for uid, s in self.sessions.items()
            if s.awaiting is not None and s.pending_obs is not None and s.client is None
        }
        try:
            cut = self.recorder.flush(next_obs)
        except OSError as exc:
            raise ProtocolError(ErrorCode.STORAGE, f"the spool cannot write the flush: {exc}") from None
        self.recorder.pump()
        acting = sum(1 for s in self.sessions.values() if s.awaiting is None)
        return {
            "cut_steps": cut,
            "acting_workers": acting,
            "evaluating": bool(self.evaluator.status().get("running")),
            "unacked_chunks": self.recorder.unacked_chunks,
        }

    def fully_stored(self) -> bool:
        """The sink acknowledged every recorded chunk."""
        return self.recorder.unacked_chunks == 0

    def resubmit_waiting(self) -> None:
        self.clients.release_held()
        if self.source is None:
            return
        for session in self.sessions.values():
            if (
                session.awaiting is not None
                and not session.submitted
                and session.client is None
                and self.collecting_for(session)
            ):
                self._submit(session)

    # -------------------------------------------------------------------- loop

    def tick(self) -> None:
        now = time.monotonic()
        for session in list(self.sessions.values()):
            if now - session.last_seen > self.config.worker_timeout_s:
                self.drop_worker(session, f"silent for {now - session.last_seen:.1f} s")
        if now > self._orphans_deadline:
            # Episodes recovered from the spool whose worker never came back.
            for uid in self.recorder.open_workers() - set(self.sessions):
                n = self.recorder.interrupt(uid)
                log.warning("worker %s did not return after restart; %d episode(s) interrupted", uid, n)
            self._orphans_deadline = float("inf")
        for session in self.sessions.values():
            durability.retry(self, session)
        self.resubmit_waiting()
        if self.source is not None:
            self.source.tick()
        self.recorder.sink.tick()

    def serve_control(self) -> None:
        """Commands waiting on the control socket, before anything else: an e-stop is
        applied before the next observation is answered, however many are queued."""
        sock = self.control.sock
        for _ in range(64):
            if not readable(sock):
                return
            self.control.on_message()

    def run(self, stop: Any = None) -> None:
        poller = zmq.Poller()
        handlers = [(self.workers_sock, self.on_worker_message), (self.clients.sock, self.clients.on_message)]
        extra = [*(self.source.sockets() if self.source else []), *self.recorder.sink.sockets()]
        for sock in [self.control.sock, *(h[0] for h in handlers), *extra]:
            poller.register(sock, zmq.POLLIN)
        links = self.workers_sock if isinstance(self.workers_sock, WorkerSockets) else None
        if links is not None:  # registered above by its epoll's descriptor
            poller.register(links.router, zmq.POLLIN)
        last_tick = last_metrics = time.monotonic()
        self.control.line.start()
        log.info("gateway serving: %s", json.dumps(self.addresses))
        # Where this process's counters start: `loopgate report` measures from it, so a run
        # shorter than the metrics interval is not taken for one that collected nothing.
        self.emit_metrics()
        while not self.state.stopping and not (stop is not None and stop.is_set()):
            events = local_link.poll(poller, int(TICK_S * 1000), links)
            turn = time.perf_counter()
            self.serve_control()
            for sock, handler in handlers:
                if sock in events:
                    for _ in range(256):  # drain what is there, but let others in
                        if not readable(sock):  # a link's bytes may not make a whole message yet
                            break
                        handler()
                        self.serve_control()
            # Sources and sinks drain their own sockets when asked for results.
            self.collect_actions()
            self.recorder.pump()
            if self.state.draining:
                self.control.answer_drains()
            now = time.monotonic()
            if now - last_tick >= TICK_S:
                self.tick()
                last_tick = now
            if now - last_metrics >= 1.0:
                self.follow_endpoints()
                self.emit_metrics()
                last_metrics = now
            self.busy_s += time.perf_counter() - turn

    def follow_endpoints(self) -> list[str]:
        """Re-point the action source and the sink at peers that moved (``endpoints.json``
        changed); the moves."""
        moved = self.endpoints.poll() if self.endpoints is not None else None
        if moved is None:
            return []
        return follow_all(moved, self.source, self.recorder.sink)

    def emit_metrics(self) -> None:
        status = self.status()
        status.pop("spec", None)
        status.pop("rtt", None)
        self.metrics.emit(
            status,
            {"rtt_us": self.rtt, **{f"hop_{name}_us": h for name, h in self.timing.hops.histograms.items()}},
        )

    def close(self) -> None:
        self.clients.close()
        self.control.close()
        self.workers_sock.close(linger=0)
        if self.source is not None:
            self.source.close()
        self.recorder.close()
        self.recorder.sink.close()
        self.metrics.close()
        self.timing.close()
