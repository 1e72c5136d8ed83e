"""The gateway's control socket: commands from the CLI, the supervisor and the trainer.

COMMAND ``{"cmd": ...}`` -> REPLY, or ERROR (``bad_request``) naming what is wrong:

- ``status``; ``pause`` / ``resume``; ``set_budget {max_env_steps}``;
- ``estop {engaged, reason}``: every worker holds (or resumes) at once;
- ``ready {worker?, env?}``: robots waiting for an operator at reset may start;
- ``evaluate {episodes}``; ``trainer_version {version, t, max_policy_lag?}``;
- ``drain {deadline_s?}``: answered once every recorded chunk is acknowledged by the sink,
  or after ``deadline_s`` with ``drained: false`` and ``spooled_steps`` (what stays in the
  spool, delivered on the next start);
- ``shutdown``.

The collection state these change (paused, e-stop, budget, draining) stays on the
:class:`~gateway.hub.Gateway`, which decides from it whether a step is answered.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import zmq

from gateway.protocol import ErrorCode, Message, MsgType, ProtocolError, recv_routed, send
from gateway.transport import CurveKeys, bind, make_socket

if TYPE_CHECKING:
    from gateway.hub import Gateway

log = logging.getLogger(__name__)


class ControlDesk:
    """Takes COMMANDs on the control socket and applies them to the gateway."""

    def __init__(self, gateway: Gateway, ctx: zmq.Context[Any], address: str, keys: CurveKeys | None) -> None:
        self.gateway = gateway
        self.sock = make_socket(ctx, zmq.ROUTER)
        self.address = bind(self.sock, address, keys)
        self.drain_replies: list[tuple[bytes, int, float]] = []
        """``drain`` requests waiting for the sink to acknowledge everything: route, seq
        and the monotonic time by which they are answered anyway."""

    def on_message(self) -> None:
        gw = self.gateway
        route, msg, err = recv_routed(self.sock, gw.limits)
        if err is not None:
            gw.reply_error(self.sock, route, err)
            return
        assert msg is not None
        try:
            if msg.type is not MsgType.COMMAND:
                raise ProtocolError(
                    ErrorCode.UNEXPECTED, f"the control socket takes COMMAND, not {msg.type.name}"
                )
            cmd = msg.meta.get("cmd")
            if cmd == "drain":
                deadline_s = msg.meta.get("deadline_s", 3600.0)
                if (
                    not isinstance(deadline_s, (int, float))
                    or isinstance(deadline_s, bool)
                    or deadline_s <= 0
                ):
                    raise ProtocolError(
                        ErrorCode.BAD_REQUEST, f"deadline_s must be a positive number, got {deadline_s!r}"
                    )
                if not gw.draining:
                    log.info("draining: closing open episodes and waiting for the sink to store them")
                gw.draining = True
                gw.recorder.drain()
                gw.clients.release_held()  # held clients hear that the run ends
                self.drain_replies.append((route, msg.seq, time.monotonic() + float(deadline_s)))
                return
            result = self.command(cmd, msg.meta)
            send(self.sock, Message(MsgType.REPLY, seq=msg.seq, meta=result), route=[route])
        except ProtocolError as exc:
            gw.reply_error(self.sock, route, exc, msg.seq)

    def answer_drains(self) -> None:
        """Answer waiting ``drain`` requests: all of them once the sink acknowledged
        everything, the others when their deadline passes (``drained: false``)."""
        if not self.drain_replies:
            return
        drained = self.gateway.recorder.unacked_chunks == 0
        now = time.monotonic()
        due = [r for r in self.drain_replies if drained or now >= r[2]]
        if not due:
            return
        status = self.gateway.status()
        if not drained:
            log.warning(
                "drain deadline: %d step(s) not stored by the sink (%s) stay in the spool, "
                "delivered when the gateway next starts on this run folder",
                status["spooled_steps"],
                status["sink"],
            )
        for route, seq, _ in due:
            meta = {"drained": drained, **status}
            send(self.sock, Message(MsgType.REPLY, seq=seq, meta=meta), route=[route])
        self.drain_replies = [r for r in self.drain_replies if r not in due]

    def command(self, cmd: Any, meta: dict[str, Any]) -> dict[str, Any]:
        gw = self.gateway
        if cmd == "status":
            return gw.status()
        if cmd == "pause":
            gw.paused = True
            return {"paused": True}
        if cmd == "resume":
            gw.paused = False
            gw.resubmit_waiting()
            return {"paused": False}
        if cmd == "set_budget":
            value = meta.get("max_env_steps")
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST, f"max_env_steps must be a positive integer, got {value!r}"
                )
            gw.max_env_steps = value
            gw.resubmit_waiting()
            return {"max_env_steps": value}
        if cmd == "estop":
            return self.estop(bool(meta.get("engaged", True)), str(meta.get("reason", "")))
        if cmd == "evaluate":
            episodes = meta.get("episodes")
            if not isinstance(episodes, int) or isinstance(episodes, bool) or episodes < 1:
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST, f"episodes must be a positive integer, got {episodes!r}"
                )
            return gw.evaluator.request(episodes, gw.env_steps)
        if cmd == "trainer_version":
            version, made, max_lag = (
                meta.get("version"),
                meta.get("t", time.time()),
                meta.get("max_policy_lag"),
            )
            if not isinstance(version, int) or version < 0 or not isinstance(made, (int, float)):
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST, f"trainer_version needs version (int) and t, got {meta}"
                )
            gw.lag.report(version, float(made), max_lag if isinstance(max_lag, int) else None)
            gw.resubmit_waiting()
            return gw.lag.status()
        if cmd == "ready":
            return self.ready(meta.get("worker"), meta.get("env"))
        if cmd == "shutdown":
            gw.stopping = True
            return {"stopping": True}
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"unknown command {cmd!r} (status, pause, resume, set_budget, estop, ready, evaluate, "
            "trainer_version, drain, shutdown)",
        )

    def estop(self, engaged: bool, reason: str = "") -> dict[str, Any]:
        """Engage or release the e-stop on every worker at once; no actions while engaged."""
        gw = self.gateway
        gw.estopped = engaged
        if engaged:
            gw.estops += 1
        command = Message(MsgType.COMMAND, meta={"cmd": "estop", "engaged": engaged, "reason": reason})
        for session in gw.sessions.values():
            send(gw.workers_sock, command, route=[session.route])
        log.warning(
            "e-stop %s (%s) on %d worker(s)", "engaged" if engaged else "released", reason, len(gw.sessions)
        )
        if not engaged:
            gw.resubmit_waiting()
        return {"estopped": engaged, "workers": len(gw.sessions)}

    def ready(self, worker: Any = None, env: Any = None) -> dict[str, Any]:
        """An operator's "ready": robots waiting at reset (``reset.wait_for_operator``) may start.

        Goes to every worker, or to ``worker`` (uid) only, optionally for one ``env``
        index; like the e-stop it travels as a COMMAND the worker hands to its backend.
        """
        sessions = self.gateway.sessions
        if worker is not None and worker not in sessions:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"no worker {worker!r}; workers: {sorted(sessions)}")
        if env is not None and (not isinstance(env, int) or isinstance(env, bool) or env < 0):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"env must be a non-negative integer, got {env!r}")
        meta: dict[str, Any] = {"cmd": "ready"} if env is None else {"cmd": "ready", "env": env}
        targets = [sessions[worker]] if worker is not None else list(sessions.values())
        for session in targets:
            send(self.gateway.workers_sock, Message(MsgType.COMMAND, meta=meta), route=[session.route])
        log.info(
            "operator ready sent to %d worker(s)%s",
            len(targets),
            f" for env {env}" if env is not None else "",
        )
        return {"ready": True, "workers": len(targets)}

    def close(self) -> None:
        self.sock.close(linger=0)
