"""When the steps an observation completes reach the spool, relative to its ACTION.

The contract: a step the gateway acknowledged is on disk. An ACTION (and a RESET)
acknowledges with two meta fields: ``acked``, how many steps were written since the
worker's last answer, and ``through``, the newest observation seq all of whose steps
are written. Two orders keep it:

- **write first** (a client drives the worker, collection is held, or the source
  answers in a later turn of the loop: an inference server computes while the
  steps are written): the observation's own steps are written before its answer
  leaves, so the answer acknowledges them (``through`` = its seq);
- **act first** (the experiment's policy runs in the gateway and answers at once):
  the ACTION leaves as soon as the policy has answered and the steps are written
  right after it, in the same turn of the loop; the *next* answer acknowledges them
  (``through`` = the previous seq). The spool write is then off the worker's round
  trip.

A worker keeps every step not yet acknowledged (at most the one before the observation
in flight) and, after a reconnect, sends it again as an OBSERVATION with
``meta["replay"]`` before its current one; a gateway records a replay (once: the
recorder drops steps it has) and answers nothing to it. So a gateway killed between an
ACTION and the write after it loses nothing: the restarted one gets the step again.

A refused write (disk full) after the ACTION left keeps the steps in memory
(``WorkerSession.unwritten``); nothing more of that worker is handled until they are
written (its next observations wait in ``WorkerSession.unspooled``, retried each tick).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from gateway.hub.accounting import account
from gateway.hub.registration import check_observation
from gateway.protocol import ErrorCode, Message, ProtocolError
from gateway.steps import StepInfo
from gateway.trajectory import Transitions

if TYPE_CHECKING:
    from gateway.hub.state import WorkerSession


# ``gw`` is the :class:`~gateway.hub.core.Gateway` (typed loosely: core imports this module).
def order(gw: Any, session: WorkerSession) -> str:
    """When an observation that completes steps goes to its policy, relative to their write:
    ``act`` (the in-process policy answers now; its ACTION leaves first), ``request`` (an
    inference server computes meanwhile; its ACTION comes after the write) or ``write``
    (a client drives the worker, or collection holds: written first)."""
    if session.client is not None or gw.source is None or not gw.collecting_for(session):
        return "write"
    return "act" if gw.source.synchronous else "request"


def spool(gw: Any, session: WorkerSession, steps: Transitions) -> int:
    """Write the transitions an observation completes to the recorder's spool; the new ones."""
    eval_flags = gw.evaluator.flags(session.uid, session.num_envs)[steps.envs]
    return int(
        gw.recorder.record(
            steps,
            worker=session.uid,
            task=gw.spec.name if gw.spec else "",
            eval_flags=eval_flags.tolist() if np.count_nonzero(eval_flags) else None,
        )
    )


def write(
    gw: Any,
    session: WorkerSession,
    msg: Message,
    info: StepInfo,
    completed: Transitions,
    old_episodes: np.ndarray | None,
    *,
    answered: bool,
    before: tuple[Any, ...],
) -> int | None:
    """Write the steps ``msg`` completes; the number of new ones, or None when the spool
    refused them: kept for a retry (``answered``: its ACTION left already) or, if not
    answered yet, the observation is handled again once the disk takes writes."""
    started = time.perf_counter()
    try:
        written = spool(gw, session, completed)
    except OSError:  # disk full: not acknowledged
        if answered:
            session.unwritten = (msg, info, completed, old_episodes)
        else:
            session.restore_answer_state(before)  # an answer already computed is dropped
            session.unspooled.append(msg)
        return None
    gw.timing.hops.add("spool_write", (time.perf_counter() - started) * 1e6)
    _written(session, msg, completed)
    return written


def _written(session: WorkerSession, msg: Message, completed: Transitions) -> None:
    # A re-sent step the recorder had already counts as acknowledged again (stored once).
    session.acked_now += len(completed)
    session.through = max(session.through, msg.seq)


def flush_unwritten(gw: Any, session: WorkerSession) -> bool:
    """Write the steps a refused write left in memory; whether none are left."""
    if session.unwritten is None:
        return True
    msg, info, completed, old_episodes = session.unwritten
    try:
        written = spool(gw, session, completed)
    except OSError:
        return False
    session.unwritten = None
    _written(session, msg, completed)
    account(gw, session, msg, info, completed, old_episodes, written)
    return True


def retry(gw: Any, session: WorkerSession) -> None:
    """Each tick: what a full disk held of this worker, oldest first, until it holds again."""
    waiting, session.unspooled = session.unspooled, []
    if not waiting:
        flush_unwritten(gw, session)
    for i, msg in enumerate(waiting):
        try:
            gw.on_observation(session, msg)
        except ProtocolError as exc:  # one queued unchecked behind a held one
            gw.reply_error(gw.workers_sock, session.route, exc, msg.seq)
        if session.unspooled:  # held again while the disk is full: the rest behind it
            session.unspooled += waiting[i + 1 :]
            return


def replay(gw: Any, session: WorkerSession, msg: Message) -> None:
    """A step its worker kept because no answer acknowledged it yet, sent again after a
    reconnect (``meta["replay"]``): recorded if new, never answered."""
    if msg.seq <= session.last_seq:
        return  # handled by this gateway: written, or waiting in ``unwritten``
    if not flush_unwritten(gw, session):
        session.unspooled.append(msg)
        return
    _obs, info = check_observation(gw.spec, session, msg)
    rows = info.has_prev.nonzero()[0] if not gw.state.draining else np.empty(0, np.int64)
    if len(rows) and "prev/action" not in msg.arrays:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, "a replayed observation must carry the step it completes (prev/*)"
        )
    completed = session.completed(msg, info, rows) if len(rows) else None
    written = 0
    if completed is not None:  # nothing answered it: a refused write waits like any observation
        done = write(gw, session, msg, info, completed, None, answered=False, before=session.answer_state())
        if done is None:
            return
        written = done
    session.last_seq = msg.seq
    account(gw, session, msg, info, completed, None, written)
