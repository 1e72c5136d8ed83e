"""Trajectory chunks: the unit in which recorded steps travel and are stored.

A chunk holds contiguous steps ``[first_step, first_step + num_steps)`` of one episode
as a ``TRAJECTORY_CHUNK`` message::

    meta:   chunk_id, episode_id, worker, env, task, first_step, num_steps,
            final (the episode ends with this chunk), end ("terminated" | "truncated" |
            "interrupted" | None), eval (evaluation episode: not for training)
    arrays: obs/<key>      [T, ...]   observation the action was taken in
            action         [T, ...]
            reward         f32[T]     reward received after the action
            terminated     bool[T]
            truncated      bool[T]
            success        bool[T]    task success after the action
            policy_version i64[T]     version of the weights that chose the action
            t_capture      f64[T]     unix time the observation was captured
            t_action       f64[T]     unix time the action left the gateway
            step           i64[T]     index of the step within its episode
            intervention   bool[T]    the action came from a takeover (a person at the
                                      console or a script), not the experiment's policy
            final_obs/<key> [1, ...]  last observation (final chunks ending by
                                      termination or truncation only)
            boot_obs/<key>  [1, ...]  the observation after the last step, on a chunk
                                      cut before its episode's end by a flush (the end
                                      of an on-policy round), so that step can bootstrap

Chunk ids are ``"<episode_id>:<first_step>"``, so a chunk sent twice (a resend after a
restart) is recognised and stored once. Steps are identified by ``(episode_id, step)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway.protocol import ErrorCode, Message, MsgType, ProtocolError, pack, unpack

STEP_FIELDS: dict[str, str] = {
    "reward": "float32",
    "terminated": "bool",
    "truncated": "bool",
    "success": "bool",
    "policy_version": "int64",
    "t_capture": "float64",
    "t_action": "float64",
    "step": "int64",
    "intervention": "bool",
}
"""Per-step scalar arrays of a chunk and their dtypes (besides ``obs/*`` and ``action``)."""

ADDED_FIELDS: dict[str, object] = {"intervention": False}
"""Step fields newer than the first spool and chunk format, with the value steps recorded
before them get: spools, logs and stores written by an older version still read."""

_STEP_DTYPES = {key: np.dtype(dtype) for key, dtype in STEP_FIELDS.items()}

END_REASONS = ("terminated", "truncated", "interrupted")


def episode_id(worker: str, env: int, episode: int) -> str:
    """The id of ``worker``'s ``episode``-th episode in env ``env``: ``"<worker>-<env>-<n>"``."""
    return f"{worker}-{env}-{episode}"


def chunk_id(episode_id: str, first_step: int) -> str:
    return f"{episode_id}:{first_step}"


@dataclass
class Transitions:
    """Recorded steps as columns, one row per step: the one step type of the data path.

    The gateway assembles them from a worker's observation (the step each row completes:
    its observation, action and ids, from the worker's ``prev/*`` arrays or from what the
    gateway sent, plus the outcome in ``step_info``), writes them to its spool as one
    record, and folds them into per-episode :class:`StepRows` that become chunks::

        t = Transitions(episodes, envs, obs, action, columns)   # columns: STEP_FIELDS
        record = t.spool_arrays()            # obs/*, action, env, scalars f64[n, 9]
        again = Transitions.from_spool(episodes, record)
    """

    episodes: Sequence[str]
    """Episode id of each row (:func:`episode_id`; a batch's are made lazily)."""
    envs: np.ndarray
    """int64[n]: the env index within its worker."""
    obs: dict[str, np.ndarray]
    """Observation the action was taken in, by key, [n, ...]."""
    action: np.ndarray
    """[n, ...]"""
    columns: dict[str, np.ndarray]
    """The per-step scalars of :data:`STEP_FIELDS`, each [n] (those of :data:`ADDED_FIELDS`
    may be left out: they get their default)."""

    def __post_init__(self) -> None:
        for key, value in ADDED_FIELDS.items():
            if key not in self.columns:
                self.columns[key] = np.full(len(self.episodes), value, STEP_FIELDS[key])

    def __len__(self) -> int:
        return len(self.episodes)

    def select(self, rows: Sequence[int]) -> Transitions:
        """The given rows only."""
        idx = np.asarray(rows, dtype=np.int64)
        return Transitions(
            [self.episodes[i] for i in rows],
            self.envs[idx],
            {k: v[idx] for k, v in self.obs.items()},
            self.action[idx],
            {k: np.asarray(v)[idx] for k, v in self.columns.items()},
        )

    def row(self, i: int) -> tuple[dict[str, np.ndarray], np.ndarray, dict[str, Any]]:
        """Row ``i`` as ``(obs, action, scalars)``, the arguments of :meth:`StepRows.add`."""
        return (
            {k: v[i] for k, v in self.obs.items()},
            self.action[i],
            {k: v[i] for k, v in self.columns.items()},
        )

    def spool_arrays(self) -> dict[str, np.ndarray]:
        """As a spool record's arrays: the scalars travel as one float64 column block (one
        frame, not nine; every value fits a float64 exactly)."""
        packed = np.empty((len(self), len(STEP_FIELDS)), dtype=np.float64)
        for j, key in enumerate(STEP_FIELDS):
            packed[:, j] = self.columns[key]
        return {
            **pack("obs", self.obs),
            "action": self.action,
            "env": np.asarray(self.envs, np.int64),
            "scalars": packed,
        }

    @classmethod
    def from_spool(cls, episodes: list[str], arrays: Mapping[str, np.ndarray]) -> Transitions:
        """Inverse of :meth:`spool_arrays`."""
        packed = arrays["scalars"]
        columns = {
            key: packed[:, j].astype(dt)
            if j < packed.shape[1]
            else np.full(len(packed), ADDED_FIELDS[key], dt)
            for j, (key, dt) in enumerate(STEP_FIELDS.items())
        }
        return cls(
            list(episodes), np.asarray(arrays["env"]), unpack("obs", arrays), arrays["action"], columns
        )


@dataclass
class StepRows:
    """Steps of one episode gathered for a chunk (each field: list of per-step arrays)."""

    episode_id: str
    worker: str
    env: int
    task: str
    eval: bool = False
    obs: dict[str, list[np.ndarray]] = field(default_factory=dict)
    action: list[np.ndarray] = field(default_factory=list)
    scalars: dict[str, list[Any]] = field(default_factory=lambda: {k: [] for k in STEP_FIELDS})

    def __len__(self) -> int:
        return len(self.action)

    @property
    def first_step(self) -> int:
        return int(self.scalars["step"][0]) if self.action else -1

    def add(self, obs: Mapping[str, np.ndarray], action: np.ndarray, **scalars: Any) -> None:
        """Append one step of this episode (``scalars``: every key of :data:`STEP_FIELDS`,
        those of :data:`ADDED_FIELDS` optional);
        a row of :class:`Transitions` is ``rows.add(*steps.row(i))``."""
        for key, value in obs.items():
            self.obs.setdefault(key, []).append(value)
        self.action.append(action)
        for key in STEP_FIELDS:
            self.scalars[key].append(scalars[key] if key in scalars else ADDED_FIELDS[key])

    def take(self, n: int) -> StepRows:
        """Split off the first ``n`` steps into a new :class:`StepRows`."""
        head = StepRows(self.episode_id, self.worker, self.env, self.task, self.eval)
        head.obs = {k: v[:n] for k, v in self.obs.items()}
        head.action = self.action[:n]
        head.scalars = {k: v[:n] for k, v in self.scalars.items()}
        self.obs = {k: v[n:] for k, v in self.obs.items()}
        self.action = self.action[n:]
        self.scalars = {k: v[n:] for k, v in self.scalars.items()}
        return head

    def select(self, rows: Sequence[int]) -> StepRows:
        """A copy holding only the given row positions."""
        out = StepRows(self.episode_id, self.worker, self.env, self.task, self.eval)
        out.obs = {k: [v[i] for i in rows] for k, v in self.obs.items()}
        out.action = [self.action[i] for i in rows]
        out.scalars = {k: [v[i] for i in rows] for k, v in self.scalars.items()}
        return out

    def to_chunk(
        self, *, end: str | None = None, final_obs: Mapping[str, np.ndarray] | None = None
    ) -> Message:
        arrays: dict[str, np.ndarray] = {}
        arrays.update(pack("obs", {k: np.stack(v) for k, v in self.obs.items()}))
        arrays["action"] = np.stack(self.action) if self.action else np.zeros((0,), np.float32)
        for key, dtype in STEP_FIELDS.items():
            arrays[key] = np.asarray(self.scalars[key], dtype=dtype)
        if final_obs is not None:
            arrays.update(pack("final_obs", {k: np.asarray(v)[None] for k, v in final_obs.items()}))
        first = self.first_step
        meta = {
            "chunk_id": chunk_id(self.episode_id, first),
            "episode_id": self.episode_id,
            "worker": self.worker,
            "env": self.env,
            "task": self.task,
            "first_step": first,
            "num_steps": len(self),
            "final": end is not None,
            "end": end,
            "eval": self.eval,
        }
        return Message(MsgType.TRAJECTORY_CHUNK, meta=meta, arrays=arrays)


def with_added_fields(msg: Message) -> Message:
    """``msg`` with the :data:`ADDED_FIELDS` a chunk of an older version lacks filled in
    (in place; returned for chaining)."""
    if "step" in msg.arrays:
        n = len(msg.arrays["step"])
        for key, value in ADDED_FIELDS.items():
            if key not in msg.arrays:
                msg.arrays[key] = np.full(n, value, STEP_FIELDS[key])
    return msg


def validate_chunk(msg: Message) -> None:
    """Raise :class:`ProtocolError` (BAD_REQUEST) naming what is wrong with a chunk; a
    chunk of an older version gets the step fields it lacks (:func:`with_added_fields`)."""

    def bad(text: str) -> ProtocolError:
        return ProtocolError(ErrorCode.BAD_REQUEST, f"trajectory chunk: {text}")

    if msg.type is not MsgType.TRAJECTORY_CHUNK:
        raise bad(f"message type is {msg.type.name}")
    meta = msg.meta
    for key, kind in (("chunk_id", str), ("episode_id", str), ("first_step", int), ("num_steps", int)):
        if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool):
            raise bad(f"meta {key!r} must be {kind.__name__}, got {meta.get(key)!r}")
    n = meta["num_steps"]
    if n < 1 or meta["first_step"] < 0:
        raise bad(f"num_steps must be >= 1 and first_step >= 0, got {n} and {meta['first_step']}")
    if meta["chunk_id"] != chunk_id(meta["episode_id"], meta["first_step"]):
        raise bad(f"chunk_id {meta['chunk_id']!r} does not match episode_id:first_step")
    if meta.get("end") not in (None, *END_REASONS):
        raise bad(f"end must be one of {END_REASONS} or null, got {meta.get('end')!r}")
    with_added_fields(msg)
    obs = unpack("obs", msg.arrays)
    if not obs:
        raise bad("no obs/* arrays")
    for key, dtype in STEP_FIELDS.items():
        arr = msg.arrays.get(key)
        if arr is None:
            raise bad(f"array {key!r} is missing")
        # Compared as dtype objects: ``dtype.name`` is slow Python code, and the store
        # validates every chunk (tens per step at thousands of envs).
        if arr.dtype != _STEP_DTYPES[key] or arr.shape != (n,):
            raise bad(f"array {key!r} is {arr.dtype}{list(arr.shape)}, expected {dtype}[{n}]")
    for key, arr in [*((f"obs/{k}", v) for k, v in obs.items()), ("action", msg.arrays.get("action"))]:
        if arr is None or arr.ndim < 1 or arr.shape[0] != n:
            raise bad(f"array {key!r} must have {n} rows")
    steps = msg.arrays["step"]
    if int(steps[0]) != meta["first_step"] or (n > 1 and not np.all(np.diff(steps) == 1)):
        raise bad("step indices must be consecutive from first_step")


@dataclass
class StoreCount:
    """Steps and episodes found by reading chunks back (never from side counters)."""

    chunks: int = 0
    duplicate_chunks: int = 0
    stored_steps: int = 0
    duplicate_steps: int = 0
    episodes: int = 0
    completed_episodes: int = 0
    interrupted_episodes: int = 0
    successful_episodes: int = 0
    eval_episodes: int = 0


def count_chunks(chunks: Iterable[Message]) -> StoreCount:
    """Count unique steps ``(episode_id, step)`` and duplicates across ``chunks``."""
    count = StoreCount()
    seen_steps: dict[str, set[int]] = {}
    seen_chunks: set[str] = set()
    ended: dict[str, str] = {}
    success: dict[str, bool] = {}
    evals: set[str] = set()
    for msg in chunks:
        count.chunks += 1
        meta = msg.meta
        if meta["chunk_id"] in seen_chunks:
            count.duplicate_chunks += 1
        seen_chunks.add(meta["chunk_id"])
        episode = meta["episode_id"]
        steps = seen_steps.setdefault(episode, set())
        for s in msg.arrays["step"].tolist():
            if s in steps:
                count.duplicate_steps += 1
            else:
                steps.add(s)
                count.stored_steps += 1
        success[episode] = success.get(episode, False) or bool(np.any(msg.arrays["success"]))
        if meta.get("eval"):
            evals.add(episode)
        if meta.get("end"):
            ended[episode] = meta["end"]
    count.episodes = len(seen_steps)
    count.completed_episodes = sum(1 for e in ended.values() if e != "interrupted")
    count.interrupted_episodes = sum(1 for e in ended.values() if e == "interrupted")
    count.successful_episodes = sum(1 for e, ok in success.items() if ok and ended.get(e) != "interrupted")
    count.eval_episodes = len(evals)
    return count


@dataclass
class Episode:
    """One episode reassembled from its chunks (steps in order)."""

    episode_id: str
    meta: dict[str, Any]
    arrays: dict[str, np.ndarray]
    end: str | None

    @property
    def num_steps(self) -> int:
        return len(self.arrays["step"])


def assemble_episodes(chunks: Sequence[Message]) -> list[Episode]:
    """Group chunks by episode, drop duplicate steps, and concatenate in step order."""
    by_episode: dict[str, dict[int, Message]] = {}
    for msg in chunks:
        by_episode.setdefault(msg.meta["episode_id"], {})[msg.meta["first_step"]] = with_added_fields(msg)
    episodes = []
    for episode_id, parts in by_episode.items():
        ordered = [parts[k] for k in sorted(parts)]
        keys = [k for k in ordered[0].arrays if not k.startswith(("final_obs/", "boot_obs/"))]
        arrays = {k: np.concatenate([np.asarray(m.arrays[k]) for m in ordered]) for k in keys}
        _, unique = np.unique(arrays["step"], return_index=True)
        arrays = {k: v[unique] for k, v in arrays.items()}
        last = ordered[-1]
        arrays.update({k: np.asarray(v) for k, v in last.arrays.items() if k.startswith("final_obs/")})
        meta = {k: v for k, v in ordered[0].meta.items() if k not in ("chunk_id", "first_step", "num_steps")}
        episodes.append(Episode(episode_id, meta, arrays, last.meta.get("end")))
    return episodes
