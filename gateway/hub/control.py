"""The gateway's control socket: commands from the CLI, the supervisor and the trainer.

COMMAND ``{"cmd": ...}`` -> REPLY, or ERROR (``bad_request``) naming what is wrong:

- ``status``; ``pause`` / ``resume``; ``set_budget {max_env_steps}``;
- ``estop {engaged, reason}``: every worker holds (or resumes) at once; an e-stop being
  engaged is applied and answered on the control socket's own thread
  (:mod:`gateway.hub.estop`), never behind the loop;
- ``ready {worker?, env?}``: robots waiting for an operator at reset may start;
- ``evaluate {episodes}``; ``trainer_version {version, t, max_policy_lag?}``;
- ``flush``: cut every open episode's held steps into chunks now (the end of an
  on-policy round), with the observation each held env waits in as the last step's next
  one; answers ``cut_steps``, ``acting_workers`` (their action is out), ``evaluating``;
- ``drain {deadline_s?}``: answered once every recorded chunk is acknowledged by the sink,
  or after ``deadline_s`` with ``drained: false`` and ``spooled_steps`` (what stays in the
  spool, delivered on the next start);
- ``shutdown``.

The collection state these change (paused, e-stop, budget, draining) is the hub's
:class:`~gateway.hub.state.Collection`, which decides whether a step is answered; the
desk sees the gateway only through :class:`~gateway.hub.state.Hub`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import zmq

from gateway.hub.estop import INTERNAL, ControlLine, estop_command
from gateway.hub.state import Hub
from gateway.protocol import ErrorCode, Message, MsgType, ProtocolError, recv_routed, send
from gateway.transport import CurveKeys

log = logging.getLogger(__name__)


class ControlDesk:
    """Takes COMMANDs on the control socket and applies them to the gateway."""

    def __init__(
        self,
        hub: Hub,
        ctx: zmq.Context[Any],
        address: str,
        keys: CurveKeys | None,
        estop_latch: Path | None = None,
    ) -> None:
        self.hub = hub
        self.line = ControlLine(
            ctx, address, hub.state, sessions=lambda: len(hub.sessions), keys=keys, latch=estop_latch
        )
        latched = self.line.restore()
        if latched is not None:
            since = latched.get("t_engaged")
            log.warning(
                "the e-stop is engaged (%s%s), latched in %s: nothing moves until it is released "
                "(the console's Resume, or the control command estop {engaged: false})",
                latched.get("reason") or "no reason given",
                f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}"
                if isinstance(since, (int, float))
                else "",
                estop_latch,
            )
        self.address = self.line.address
        self.sock = self.line.sock
        """The loop's end of the control socket (ROUTER-framed), fed by :attr:`line`."""
        self.drain_replies: list[tuple[bytes, int, float]] = []
        """``drain`` requests waiting for the sink to acknowledge everything: route, seq
        and the monotonic time by which they are answered anyway."""

    def on_message(self) -> None:
        hub = self.hub
        route, msg, err = recv_routed(self.sock, hub.limits)
        if err is not None:
            hub.reply_error(self.sock, route, err)
            return
        assert msg is not None
        if route == INTERNAL:  # the line engaged an e-stop: now every worker's socket hears it
            self.notify_workers(msg)
            return
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
                hub.begin_drain()
                self.drain_replies.append((route, msg.seq, time.monotonic() + float(deadline_s)))
                return
            result = self.command(cmd, msg.meta)
            send(self.sock, Message(MsgType.REPLY, seq=msg.seq, meta=result), route=[route])
        except ProtocolError as exc:
            hub.reply_error(self.sock, route, exc, msg.seq)

    def answer_drains(self) -> None:
        """Answer waiting ``drain`` requests: all of them once the sink acknowledged
        everything, the others when their deadline passes (``drained: false``)."""
        if not self.drain_replies:
            return
        drained = self.hub.fully_stored()
        now = time.monotonic()
        due = [r for r in self.drain_replies if drained or now >= r[2]]
        if not due:
            return
        status = self.hub.status()
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
        hub = self.hub
        if cmd == "status":
            return hub.status()
        if cmd == "pause":
            hub.state.paused = True
            return {"paused": True}
        if cmd == "resume":
            hub.state.paused = False
            hub.resubmit_waiting()
            return {"paused": False}
        if cmd == "set_budget":
            value = meta.get("max_env_steps")
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST, f"max_env_steps must be a positive integer, got {value!r}"
                )
            hub.state.max_env_steps = value
            hub.resubmit_waiting()
            return {"max_env_steps": value}
        if cmd == "estop":
            epoch = meta.get("epoch")
            return self.estop(
                bool(meta.get("engaged", True)),
                str(meta.get("reason", "")),
                epoch=epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None,
            )
        if cmd == "evaluate":
            episodes = meta.get("episodes")
            if not isinstance(episodes, int) or isinstance(episodes, bool) or episodes < 1:
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST, f"episodes must be a positive integer, got {episodes!r}"
                )
            return hub.evaluator.request(episodes, hub.state.env_steps)
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
            hub.lag.report(version, float(made), max_lag if isinstance(max_lag, int) else None)
            hub.resubmit_waiting()
            return hub.lag.status()
        if cmd == "ready":
            return self.ready(meta.get("worker"), meta.get("env"))
        if cmd == "flush":
            return hub.flush_open()
        if cmd == "shutdown":
            hub.state.stopping = True
            return {"stopping": True}
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"unknown command {cmd!r} (status, pause, resume, set_budget, estop, ready, evaluate, "
            "trainer_version, flush, drain, shutdown)",
        )

    def estop(self, engaged: bool, reason: str = "", *, epoch: int | None = None) -> dict[str, Any]:
        """Engage or release the e-stop on every worker at once; no actions while engaged.

        Engaging from the control socket happens on its line (:mod:`gateway.hub.estop`);
        this engages for callers in the loop. A release carries the epoch the line gave it
        and is superseded (changes nothing) when a later e-stop command came in."""
        hub = self.hub
        if engaged:
            epoch = self.line.next_epoch(True)
            self.notify_workers(estop_command(True, reason, epoch))
            self.line.keep_engaged(reason)
            return {"estopped": True, "workers": len(hub.sessions), "epoch": epoch}
        if not self.line.release(epoch):
            log.warning("e-stop release (%s) superseded by a later e-stop command", reason)
            return {"estopped": hub.state.estopped, "superseded": True, "workers": len(hub.sessions)}
        self.notify_workers(estop_command(False, reason, hub.state.estop_epoch))
        hub.resubmit_waiting()
        return {"estopped": False, "workers": len(hub.sessions), "epoch": hub.state.estop_epoch}

    def notify_workers(self, command: Message) -> None:
        """An e-stop COMMAND to every worker over the workers' socket (the bus has it too)."""
        meta = command.meta
        self.hub.send_to_workers(command)
        log.warning(
            "e-stop %s (%s) on %d worker(s)",
            "engaged" if meta.get("engaged") else "released",
            meta.get("reason", ""),
            len(self.hub.sessions),
        )

    def ready(self, worker: Any = None, env: Any = None) -> dict[str, Any]:
        """An operator's "ready": robots waiting at reset (``reset.wait_for_operator``) may start.

        Goes to every worker, or to ``worker`` (uid) only, optionally for one ``env``
        index; like the e-stop it travels as a COMMAND the worker hands to its backend.
        """
        sessions = self.hub.sessions
        if worker is not None and worker not in sessions:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"no worker {worker!r}; workers: {sorted(sessions)}")
        if env is not None and (not isinstance(env, int) or isinstance(env, bool) or env < 0):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"env must be a non-negative integer, got {env!r}")
        meta: dict[str, Any] = {"cmd": "ready"} if env is None else {"cmd": "ready", "env": env}
        targets = [sessions[worker]] if worker is not None else list(sessions.values())
        self.hub.send_to_workers(Message(MsgType.COMMAND, meta=meta), targets)
        log.info(
            "operator ready sent to %d worker(s)%s",
            len(targets),
            f" for env {env}" if env is not None else "",
        )
        return {"ready": True, "workers": len(targets)}

    def close(self) -> None:
        self.line.close()
