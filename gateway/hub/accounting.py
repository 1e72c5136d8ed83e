"""What the gateway does with a worker's observation after its ACTION left: episode ends,
resets, evaluation and lag, over the whole batch with numpy (no loop per env per step).

Called by :meth:`gateway.hub.core.Gateway.on_observation` once the steps the
observation completes are in the spool. Loops run only over the envs an event concerns:
those whose episode ended (one spool record for all of them) and those a reset started
afresh, which at ``K`` envs and ``T``-step episodes is about ``K / T`` per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from gateway.env_columns import EpisodeIds
from gateway.protocol import Message, unpack
from gateway.steps import StepInfo
from gateway.trajectory import Transitions

if TYPE_CHECKING:
    from gateway.hub.state import WorkerSession


# ``gw`` is the :class:`~gateway.hub.core.Gateway` (typed loosely: core imports this module).
def account(
    gw: Any,
    session: WorkerSession,
    msg: Message,
    info: StepInfo,
    completed: Transitions | None,
    old_episodes: np.ndarray | None,
    written: int,
) -> None:
    """Chunking, episode ends, evaluation and lag for the steps just spooled."""
    recorder, evaluator, uid, n = gw.recorder, gw.evaluator, session.uid, session.num_envs
    recorder.apply_pending()
    terminated, truncated = info.terminated, info.truncated
    done = terminated | truncated
    if completed is not None:
        rows, versions = completed.envs, completed.columns["policy_version"]
        gw.lag.observe(versions, np.asarray(completed.columns["t_action"]))
        evaluator.steps(uid, rows, info.reward[rows], info.success[rows], versions, done[rows], n)
        ended = done[rows].nonzero()[0]
        if len(ended):
            envs = rows[ended]
            ids = completed.episodes
            numbers = ids.numbers[ended] if isinstance(ids, EpisodeIds) else None
            reasons = np.where(terminated[envs], "terminated", "truncated").tolist()
            final = unpack("final_obs", msg.arrays)
            final_rows = {k: v[envs] for k, v in final.items()} if final else None
            if numbers is None:  # ids made elsewhere as strings: one end each
                for j, r in enumerate(ended.tolist()):
                    fo = {k: v[j] for k, v in final_rows.items()} if final_rows else None
                    recorder.end(ids[r], reasons[j], fo)
            else:
                recorder.end_many(uid, envs, numbers, reasons, final_rows)
        session.env_steps += written
        gw.state.env_steps += written
    # Envs that start a new episode without finishing the old one (a reset) leave it
    # interrupted; its steps so far are kept.
    fresh = (~info.has_prev).nonzero()[0]
    if len(fresh):
        if old_episodes is not None:
            envs = fresh[fresh < len(old_episodes)]
            recorder.end_many(uid, envs, old_episodes[envs], ["interrupted"] * len(envs))
        for i in fresh.tolist():
            evaluator.interrupted(uid, i)
    # Every episode that starts now may be an evaluation episode.
    starting = (~info.has_prev | done).nonzero()[0]
    if len(starting):
        r = evaluator.round
        if r is None or r.done or r.assigned >= r.requested:
            evaluator.flags(uid, n)[starting] = False  # no round takes episodes now
        else:
            for i in starting.tolist():
                evaluator.new_episode(uid, i, n)
    gw.note_rate()
