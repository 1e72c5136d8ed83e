"""What a worker says first, and what every observation must be.

:func:`register` answers a worker's HELLO: its env spec is checked against the
experiment's (the first worker's, when the config gave none), its session is made or
taken over (a worker that reconnects keeps its episodes), and the WELCOME tells it the
heartbeat, the e-stop bus and the fast paths (shared memory, CUDA IPC, the unix link) it
may use. A worker joining while the e-stop is engaged hears so at once.

:func:`check_observation` is the one place an OBSERVATION's shape is checked, for a live
one and for a replay alike.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from gateway import steps
from gateway.episode import EnvSpec
from gateway.hub.state import WorkerSession, accept_cuda, attach_ring
from gateway.local_link import WorkerSockets
from gateway.protocol import ErrorCode, Message, MsgType, ProtocolError, send, unpack
from gateway.protocol.schemas import WORKER_OBSERVATION
from gateway.steps import StepInfo

log = logging.getLogger(__name__)


# ``gw`` is the :class:`~gateway.hub.core.Gateway` (typed loosely: core imports this module).
def register(gw: Any, route: bytes, msg: Message) -> None:
    """A worker's HELLO: check its spec, make or take over its session, WELCOME it."""
    meta = msg.meta
    uid, num_envs = meta.get("uid"), meta.get("num_envs")
    if not isinstance(uid, str) or not uid or not isinstance(num_envs, int) or num_envs < 1:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "HELLO needs meta uid (string) and num_envs (int >= 1)")
    try:
        spec = EnvSpec.from_dict(meta.get("spec") or {})
    except ValueError as exc:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"HELLO carries an invalid spec: {exc}") from None
    if gw.spec is None:
        gw.spec = spec
        gw.evaluator.success_signal = bool(spec.metadata.get("success_signal", True))
        log.info("experiment spec taken from the first worker: %s", spec.name)
    problems = gw.spec.mismatches(spec)
    if problems:
        raise ProtocolError(
            ErrorCode.SPEC_MISMATCH,
            f"worker {uid}'s env spec does not match the experiment's: {'; '.join(problems)}",
        )
    session = _session(gw, uid, num_envs, route)
    pid = meta.get("pid")
    session.pid = pid if isinstance(pid, int) and not isinstance(pid, bool) else None
    log.info("worker %s registered (%d envs%s)", uid, num_envs, ", resuming" if meta.get("resume") else "")
    welcome = {
        "uid": uid,
        "heartbeat_s": gw.config.heartbeat_s,
        "reset_required": any(e in gw.recorder.closed for e in meta.get("episodes", [])),
        "estop_bus": gw.control.line.bus_address,
        "local_link": isinstance(gw.workers_sock, WorkerSockets),
    }
    session.shm, ring = attach_ring(meta.get("shm"), gw.config.shared_memory, uid)
    if ring is not None:
        welcome["shm"] = ring
    takes = gw.source is not None and gw.source.takes_device_obs
    session.cuda, cuda = accept_cuda(meta.get("cuda_ipc"), gw.config.cuda_ipc, uid, takes, gw.limits)
    if cuda is not None:
        welcome["cuda_ipc"] = cuda
    send(gw.workers_sock, Message(MsgType.WELCOME, seq=msg.seq, meta=welcome), route=[route])
    if gw.state.estopped:  # a robot joining during an e-stop must hold too
        command = {
            "cmd": "estop",
            "engaged": True,
            "reason": "engaged before this worker joined",
            "epoch": gw.state.estop_epoch,
        }
        send(gw.workers_sock, Message(MsgType.COMMAND, meta=command), route=[route])


def _session(gw: Any, uid: str, num_envs: int, route: bytes) -> WorkerSession:
    """The worker's session: its old one when it reconnects (nothing awaited any more)."""
    session: WorkerSession | None = gw.sessions.get(uid)
    if session is not None:
        gw.by_route.pop(session.route, None)
        session.route, session.last_seen = route, time.monotonic()
        session.awaiting, session.submitted = None, False
    else:
        session = WorkerSession(uid=uid, route=route, num_envs=num_envs, last_seen=time.monotonic())
        gw.sessions[uid] = session
    gw.by_route[route] = uid
    return session


def check_observation(
    spec: EnvSpec, session: WorkerSession, msg: Message
) -> tuple[dict[str, np.ndarray], StepInfo]:
    """The observation and its step info, or a ``bad_request`` naming every problem."""
    n = session.num_envs
    problems = WORKER_OBSERVATION.problems(msg)
    obs = unpack("obs", msg.arrays)
    problems += spec.check_observation(obs, n)
    info = msg.arrays.get("step_info")
    if info is None or info.dtype != np.float64 or info.shape != (n, steps.WIDTH):
        got = "missing" if info is None else f"{info.dtype}{list(info.shape)}"
        problems.append(f"'step_info' must be float64[{n}, {steps.WIDTH}], got {got}")
    if problems or info is None:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "observation: " + "; ".join(problems))
    return obs, StepInfo(info)
