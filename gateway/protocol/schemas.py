"""Every message layout of the data path, declared once, next to the codec.

The codec (:mod:`gateway.protocol.codec`) checks frames, dtypes and sizes; a
:class:`Schema` says which arrays and meta keys one message of one socket carries, and
:meth:`Schema.problems` checks a decoded message against it (shapes against the env
spec are the receiver's job: it knows ``num_envs``). ``K`` is the number of envs of a
worker (or rows of a request)::

    problems = WORKER_OBSERVATION.problems(msg)   # [] or what is missing / unexpected
    if problems:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "observation: " + "; ".join(problems))

Each schema's ``doc`` gives its layout; ``docs/protocol.md`` draws the exchanges.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from gateway.protocol.messages import Message, MsgType


@dataclass(frozen=True)
class Schema:
    """The arrays and meta of one message type on one socket."""

    name: str
    type: MsgType
    arrays: tuple[str, ...] = ()
    """Arrays that must be present."""
    prefixes: tuple[str, ...] = ()
    """Groups of arrays (``obs/<key>``): at least one array under each."""
    optional: tuple[str, ...] = ()
    """Arrays and groups (ending in ``/``) that may be present."""
    meta: tuple[str, ...] = ()
    """Meta keys that must be present."""
    doc: str = ""

    @functools.cached_property
    def _allowed(self) -> tuple[frozenset[str], tuple[str, ...]]:
        """Array names and group prefixes a message may carry (worked out once, not per message)."""
        groups = tuple(p for p in (*self.prefixes, *self.optional) if p.endswith("/"))
        return frozenset(self.arrays) | {o for o in self.optional if not o.endswith("/")}, groups

    @functools.cached_property
    def _seen(self) -> dict[tuple[str, ...], tuple[str, ...]]:
        """What each set of array names lacks or has too many of, by the names in order:
        a peer sends the same names with every message (2.3 -> 0.5 us a worker observation)."""
        return {}

    def problems(self, msg: Message) -> list[str]:
        """What in ``msg`` does not fit this layout (empty when it fits)."""
        out = []
        if msg.type is not self.type:
            out.append(f"{self.name} is a {self.type.name} message, got {msg.type.name}")
        names = tuple(msg.arrays)
        seen = self._seen
        found = seen.get(names)
        if found is None:
            found = self._array_problems(names)
            if len(seen) >= MAX_SEEN:
                seen.clear()
            seen[names] = found
        out.extend(found)
        for key in self.meta:
            if key not in msg.meta:
                out.append(f"meta {key!r} is missing")
        return out

    def _array_problems(self, names: tuple[str, ...]) -> tuple[str, ...]:
        out = []
        for key in self.arrays:
            if key not in names:
                out.append(f"array {key!r} is missing")
        for prefix in self.prefixes:
            if not any(n.startswith(prefix) for n in names):
                out.append(f"no {prefix}* arrays")
        allowed, groups = self._allowed
        unexpected = sorted(n for n in names if n not in allowed and not n.startswith(groups))
        if unexpected:
            out.append(f"unexpected array(s) {unexpected} in a {self.name}")
        return tuple(out)


MAX_SEEN = 1024
"""Sets of array names a schema keeps the answer for; past this it starts again."""


PREV = (
    "prev/obs/",
    "prev/action",
    "prev/policy_version",
    "prev/t_action",
    "prev/t_capture",
    "prev/episode",
    "prev/step",
)

WORKER_OBSERVATION = Schema(
    "worker observation",
    MsgType.OBSERVATION,
    arrays=("step_info",),
    prefixes=("obs/",),
    optional=("final_obs/", *PREV),
    doc="env worker -> gateway: obs/<key> [K, ...]; step_info f64[K, 8] (gateway.steps.COLUMNS); "
    "final_obs/<key> [K, ...] when an episode ended; prev/* (the step this message completes: the "
    "first message after a reconnect). meta: uid, rtt_us, reset, hops_us, env_log (a simulator's "
    "episode statistics, on steps with a reset), shm (handles of arrays in a shared-memory slot: "
    "gateway.shm), cuda_ipc (slot and event of the same observations in the worker's GPU ring: "
    "gateway.cuda_ipc).",
)
CLIENT_OBSERVATION = Schema(
    "client observation",
    MsgType.OBSERVATION,
    arrays=("step_info",),
    prefixes=("obs/",),
    optional=("final_obs/",),
    meta=("worker", "reset"),
    doc="gateway -> gateway.client: a worker observation without prev/*. meta: worker, reset.",
)
ACTION = Schema(
    "action",
    MsgType.ACTION,
    arrays=("action",),
    optional=("policy_version",),
    doc="gateway -> env worker, inference server -> gateway: action [K, ...]; policy_version i64[K] "
    "unless meta version is one version for every row. meta: acked, t_action (to workers).",
)
CLIENT_STEP = Schema(
    "client step",
    MsgType.STEP,
    arrays=("action",),
    optional=("policy_version",),
    doc="gateway.client -> gateway: action [K, ...] for the attached worker's envs; policy_version "
    "i64[K] when a policy chose some of them (else the version given at HELLO). meta: intervention "
    "(optional, one bool per env: the envs a person drove).",
)
INFERENCE_REQUEST = Schema(
    "inference request",
    MsgType.INFER,
    optional=("obs/", "deterministic"),
    doc="gateway -> inference server: obs/<key> [rows, ...], or instead meta cuda_ipc (a handle of "
    "them on the server's GPU: gateway.cuda_ipc); deterministic bool[rows] (per row) or meta "
    "deterministic (all rows); meta deadline_ms (default: the server's).",
)
TRAJECTORY_CHUNK = Schema(
    "trajectory chunk",
    MsgType.TRAJECTORY_CHUNK,
    arrays=(
        "action",
        "reward",
        "terminated",
        "truncated",
        "success",
        "policy_version",
        "t_capture",
        "t_action",
        "step",
    ),
    prefixes=("obs/",),
    optional=("final_obs/",),
    meta=("chunk_id", "episode_id", "first_step", "num_steps"),
    doc="gateway -> replay service: one episode's steps [T, ...] (gateway.trajectory; "
    "validate_chunk checks dtypes and step order).",
)

SCHEMAS = (WORKER_OBSERVATION, CLIENT_OBSERVATION, ACTION, CLIENT_STEP, INFERENCE_REQUEST, TRAJECTORY_CHUNK)
"""Every layout above, for documentation and tests."""
