"""What the gateway knows, apart from its sockets: worker sessions and the collection state.

:class:`Collection` says whether a step may be taken now, and if not why
(:meth:`Collection.hold_reason`); the same answer holds the gateway's own policy and
scripts driving workers through :mod:`gateway.client`. :class:`WorkerSession` is one
registered env worker. The control and client desks (:mod:`gateway.hub.control`,
:mod:`gateway.hub.clients`) change these through :class:`Hub`, the narrow interface
the gateway offers them, never its attributes::

    state = Collection(max_env_steps=20_000)
    state.paused = True
    state.hold_reason(sink_blocked=False, lag_exceeded=False, evaluating=False)  # "paused"
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from gateway.cuda_handles import RingOffer
from gateway.env_columns import EpisodeIds
from gateway.episode import EnvSpec
from gateway.evaluation import Evaluator, LagTracker
from gateway.protocol import ErrorCode, Limits, Message, ProtocolError, unpack
from gateway.protocol.codec import FrameSocket
from gateway.shm import ShmView
from gateway.steps import StepInfo, filled
from gateway.trajectory import Transitions

log = logging.getLogger(__name__)

HOLD_MESSAGES = {
    "estop": "the e-stop is engaged; steps resume once it is released",
    "draining": "the run is ending; no further steps are taken",
    "paused": "collection is paused; steps resume with `resume`",
    "budget": "the step budget (max_env_steps={budget}) is reached",
    "backpressure": "the trajectory sink is not storing ({sink}); steps so far are safe in the spool",
    "storage": "the gateway's spool cannot write ({spool}); collection holds until it can, and "
    "nothing acknowledged is lost",
    "policy_lag": "the policy lags the trainer by more than max_policy_lag versions",
}
"""What a held peer is told, by hold reason."""


@dataclass
class Collection:
    """The collection state the control socket changes and every step consults."""

    max_env_steps: int | None = None
    """The step budget (None: none)."""
    env_steps: int = 0
    """Steps recorded so far (this run, including those recovered from the spool)."""
    paused: bool = False
    estopped: bool = False
    estops: int = 0
    """How often the e-stop was engaged."""
    estop_epoch: int = 0
    """The newest e-stop command's number (engaged or released), in arrival order: workers
    apply an e-stop command only if it is newer than the last they applied."""
    draining: bool = False
    """The run is ending: every episode was flushed; no step is recorded any more."""
    stopping: bool = False
    """The gateway's loop ends at its next turn."""

    @property
    def budget_reached(self) -> bool:
        return self.max_env_steps is not None and self.env_steps >= self.max_env_steps

    def hold_reason(
        self, *, sink_blocked: bool, lag_exceeded: bool, evaluating: bool, spool_failing: bool = False
    ) -> str | None:
        """Why no step may be taken now, or None: ``estop``, ``draining`` (the run is
        ending), ``paused``, ``budget`` (spent, and no evaluation round running: evaluations
        run outside the budget), ``storage`` (the spool cannot write: disk full),
        ``backpressure`` (the sink is not storing, and ``evaluating`` does not lift it: an
        evaluation's steps never reach a replay table, so a trainer that samples slowly
        must not pace a round; the gateway lifts it per worker, for those the round needs;
        what the sink cannot take meanwhile waits in the spool, and a round is a bounded
        number of episodes) or
        ``policy_lag`` (callers pass ``lag_exceeded`` only for the experiment's own policy)."""
        if self.estopped:
            return "estop"
        if self.draining:
            return "draining"
        if self.paused:
            return "paused"
        if self.budget_reached and not evaluating:
            return "budget"
        if spool_failing:
            return "storage"
        if sink_blocked and not evaluating:
            return "backpressure"
        if lag_exceeded:
            return "policy_lag"
        return None


@dataclass
class WorkerSession:
    """What the gateway knows about one registered worker."""

    uid: str
    route: bytes
    num_envs: int
    last_seen: float
    pending_obs: dict[str, np.ndarray] | None = None
    pending_ids: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    """(episode, step, t_capture) per env of the observation waiting for an action."""
    action: np.ndarray | None = None
    versions: np.ndarray | None = None
    t_action: float = 0.0
    awaiting: int | None = None
    """Seq of the observation waiting for an action (None: none waiting)."""
    submitted: bool = False
    no_action: int = 0
    """Times in a row the policy gave no action for the observation awaiting one."""
    no_action_logged: float = 0.0
    """When that was last logged (monotonic s)."""
    last_seq: int = -1
    last_reply: Message | None = None
    client: bytes | None = None
    pid: int | None = None
    """The worker's process id, as its HELLO gave it (on its own host)."""
    env_steps: int = 0
    rtt_us: float = 0.0
    held: bool = False
    """Its last observation was held (a hold reason applied): the round trip the worker
    reports for it measures the hold, not the data path."""
    acked_now: int = 0
    """Steps written since the worker's last answer (its ``meta["acked"]``)."""
    through: int = -1
    """The newest observation seq all of whose steps are written (an answer's
    ``meta["through"]``; see :mod:`gateway.hub.durability`)."""
    unwritten: tuple[Message, StepInfo, Transitions, np.ndarray | None] | None = None
    """Steps the spool refused (disk full) after their ACTION left: written before
    anything else of this worker is handled."""
    t_received: float = 0.0
    """When the observation being answered arrived (wall clock, for the ``gateway`` hop)."""
    t_submitted: float = 0.0
    """When it went to the action source (``perf_counter``, for the ``policy`` hop)."""
    trace: dict[str, Any] | None = None
    """A sampled step being traced: its timestamps so far (``trace.jsonl``)."""
    unspooled: list[Message] = field(default_factory=list)
    """Observations waiting for the spool (disk full), oldest first: handled again, and
    only then answered, once it writes again."""
    shm: ShmView | None = None
    """The worker's shared-memory ring, mapped (:mod:`gateway.shm`); None: frames only."""
    shm_bytes: int = 0
    """Array bytes of its observations read in place from shared memory."""
    frame_bytes: int = 0
    """Array bytes of its observations that came as frames (copied through the socket)."""
    cuda: RingOffer | None = None
    """The worker's ring of GPU buffers (:mod:`gateway.cuda_ipc`), accepted; None: none."""
    device_obs: dict[str, Any] | None = None
    """The CUDA IPC handle of the observation waiting for an action, for the action source."""
    takeover_seq: int | None = None
    """Seq of the last observation a takeover client answered (:mod:`gateway.hub.clients`):
    the steps the next observation completes are interventions."""
    takeover_envs: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    """bool[K]: which envs of that answer a person drove (set with ``takeover_seq``)."""

    ANSWER_STATE = (
        "last_seq",
        "last_reply",
        "pending_obs",
        "pending_ids",
        "awaiting",
        "submitted",
        "acked_now",
        "t_received",
    )
    """What taking an observation for an answer changes (undone when its steps cannot be
    written: the observation is handled again, as if for the first time, once they can)."""

    def answer_state(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.ANSWER_STATE)

    def restore_answer_state(self, saved: tuple[Any, ...]) -> None:
        for name, value in zip(self.ANSWER_STATE, saved, strict=True):
            setattr(self, name, value)

    def receive(self, msg: Message) -> Message:
        """An OBSERVATION with the arrays its shared-memory handles name put in place."""
        self.frame_bytes += sum(a.nbytes for a in msg.arrays.values())
        if "shm" not in msg.meta:
            return msg
        if self.shm is None:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                "observation carries shared-memory handles but no segment of this worker is mapped; "
                "register (HELLO) with a shm offer first",
            )
        before = self.shm.bytes_shared
        msg = self.shm.decode(msg)
        self.shm_bytes += self.shm.bytes_shared - before
        return msg

    def device_handle(self, msg: Message) -> dict[str, Any] | None:
        """The CUDA IPC handle for an observation's ``meta["cuda_ipc"]`` (None without one, or
        when this worker's ring was not accepted: its host arrays serve alone)."""
        step = msg.meta.get("cuda_ipc")
        return None if step is None or self.cuda is None else self.cuda.handle(step)

    def completed(self, msg: Message, info: StepInfo, rows: np.ndarray) -> Transitions:
        """The steps rows ``rows`` of observation ``msg`` complete: observation, action and
        ids from the message's ``prev/*`` arrays (a resend after a reconnect), else from
        what this session sent last; the outcome from its ``step_info``."""
        a = msg.arrays
        if "prev/action" in a:
            obs = {k: v[rows] for k, v in unpack("prev/obs", a).items()}
            action, episode, step = a["prev/action"][rows], a["prev/episode"][rows], a["prev/step"][rows]
            versions = np.asarray(a["prev/policy_version"][rows], dtype=np.int64)
            t_action, t_capture = a["prev/t_action"][rows], a["prev/t_capture"][rows]
        elif self.pending_obs is None or self.action is None or self.pending_ids is None:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                "observation completes a step the gateway has no record of; resend it with prev/* arrays",
            )
        else:
            assert self.versions is not None
            episodes, steps, captures = self.pending_ids
            full = len(rows) == self.num_envs
            obs = self.pending_obs if full else {k: v[rows] for k, v in self.pending_obs.items()}
            action = self.action if full else self.action[rows]
            versions = self.versions if full else self.versions[rows]
            t_action, t_capture = filled(len(rows), self.t_action), captures[rows]
            episode, step = episodes[rows], steps[rows]
        columns = {
            "reward": info.reward[rows],
            "terminated": info.terminated[rows],
            "truncated": info.truncated[rows],
            "success": info.success[rows],
            "policy_version": versions,
            "t_capture": t_capture,
            "t_action": t_action,
            "step": np.asarray(step, dtype=np.int64),
            "intervention": self.takeover_envs[rows]
            if self.takeover_seq == self.last_seq
            else np.zeros(len(rows), bool),
        }
        # Ids as two arrays: strings are made only for the episodes a chunk or an end names.
        return Transitions(EpisodeIds(self.uid, rows, np.asarray(episode)), rows, obs, action, columns)


def attach_ring(offer: Any, mode: str, uid: str) -> tuple[ShmView | None, dict[str, Any] | None]:
    """Map the ring a worker's HELLO offers (``gateway.shared_memory`` = ``mode``): the
    view, and the answer for WELCOME (None when nothing was offered)."""
    if offer is None:
        return None, None
    if not isinstance(offer, dict):
        return None, {"ok": False, "reason": "meta shm must be a map"}
    try:
        if mode == "off":
            ShmView.discard(offer)
            raise ValueError("gateway.shared_memory is off")
        view = ShmView.attach(offer)
    except ValueError as exc:
        log.info("worker %s: no shared memory (%s); frames", uid, exc)
        return None, {"ok": False, "reason": str(exc)}
    log.info(
        "worker %s: observations through shared memory (%d x %d bytes)",
        uid,
        view.seg.slots,
        view.seg.slot_bytes,
    )
    return view, {"ok": True}


def accept_cuda(
    offer: Any, mode: str, uid: str, takes: bool, limits: Limits
) -> tuple[RingOffer | None, dict[str, Any] | None]:
    """A worker's CUDA IPC offer (``gateway.cuda_ipc`` = ``mode``; ``takes``: the action
    source can pass handles on): the kept offer, and WELCOME's answer (None: no offer)."""
    if offer is None:
        return None, None
    try:
        if mode == "off":
            raise ValueError("gateway.cuda_ipc is off")
        if not takes:
            raise ValueError("the policy is not served by inference servers")
        ring = RingOffer.parse(offer, limits)
    except ValueError as exc:
        log.info("worker %s: no CUDA IPC (%s); inference gets host arrays", uid, exc)
        return None, {"ok": False, "reason": str(exc)}
    log.info("worker %s: observations also as CUDA IPC handles (%d slots)", uid, len(ring.slots))
    return ring, {"ok": True}


class Hub(Protocol):
    """What the control and client desks may see and do of the gateway."""

    state: Collection
    sessions: dict[str, WorkerSession]
    spec: EnvSpec | None
    limits: Limits
    evaluator: Evaluator
    lag: LagTracker
    worker_timeout_s: float
    policy_drives: bool
    """The experiment's own policy acts (``policy.kind`` is not ``external``)."""

    def status(self) -> dict[str, Any]: ...

    def hold_reason(self, *, policy: bool = True) -> str | None: ...

    def hold_message(self, reason: str) -> str: ...

    def reply_error(self, sock: FrameSocket, route: bytes, exc: ProtocolError, seq: int = 0) -> None: ...

    def send_to_workers(self, msg: Message, sessions: list[WorkerSession] | None = None) -> None: ...

    def send_action(
        self, session: WorkerSession, seq: int, actions: np.ndarray, versions: np.ndarray
    ) -> None: ...

    def send_reset(
        self, session: WorkerSession, seed: int | None, options: dict[str, Any] | None
    ) -> None: ...

    def resubmit_waiting(self) -> None: ...

    def begin_drain(self) -> None: ...

    def fully_stored(self) -> bool: ...

    def flush_open(self) -> dict[str, Any]: ...
