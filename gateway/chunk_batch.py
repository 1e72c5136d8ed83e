"""Many episodes' trajectory chunks as one message: how a worker's chunks reach the local store.

A 4096-env worker with 100-step episodes and ``chunk_steps: 64`` closes about 80 chunks
on every step. As one :class:`~gateway.protocol.Message` each, the per-chunk Python work
(the message, its validation, its msgpack header, its checksum and ``writev``, its
acknowledgement) was what bounded the gateway, not the bytes. A chunk batch carries the
chunks one worker's step closes in one message: the rows of every chunk concatenated,
and per chunk its env, episode number, first step, length, end and eval flag as arrays::

    meta:   kind "chunk_batch", batch_id, worker, task
    arrays: obs/<key> [N, ...], action [N, ...], scalars f64[N, 9] (STEP_FIELDS packed),
            chunk/env, chunk/episode, chunk/first_step, chunk/num_steps  i64[m]
            chunk/end i8[m] (0: open, 1 + index in END_REASONS), chunk/eval bool[m]
            chunk/final bool[m] and final_obs/<key> [m, ...] (rows where chunk/final)

The chunks inside are exactly the ones the per-chunk path would cut (same ids, same
boundaries); a reader sees them one by one through :func:`expand` (views, no copies), so
the store's readers, the replay log and exports are unchanged. Deduplication stays per
chunk id (:func:`chunk_ids`, :func:`select`): a batch re-sent in part after a restart is
stored once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from gateway.protocol import ErrorCode, Message, MsgType, ProtocolError, pack, unpack
from gateway.trajectory import END_REASONS, STEP_FIELDS, chunk_id, episode_id

KIND = "chunk_batch"
_PER_CHUNK = ("env", "episode", "first_step", "num_steps", "end", "eval", "final")


def is_batch(msg: Message) -> bool:
    return msg.meta.get("kind") == KIND


def make_batch(
    batch_id: str,
    worker: str,
    task: str,
    *,
    obs: Mapping[str, np.ndarray],
    action: np.ndarray,
    scalars: np.ndarray,
    env: np.ndarray,
    episode: np.ndarray,
    first_step: np.ndarray,
    num_steps: np.ndarray,
    end: np.ndarray,
    eval_flags: np.ndarray,
    final: np.ndarray | None = None,
    final_obs: Mapping[str, np.ndarray] | None = None,
) -> Message:
    """A batch of ``len(env)`` chunks whose rows lie back to back in ``obs``/``action``/``scalars``."""
    m = len(env)
    arrays: dict[str, np.ndarray] = {**pack("obs", obs), "action": action, "scalars": scalars}
    arrays["chunk/env"] = np.asarray(env, np.int64)
    arrays["chunk/episode"] = np.asarray(episode, np.int64)
    arrays["chunk/first_step"] = np.asarray(first_step, np.int64)
    arrays["chunk/num_steps"] = np.asarray(num_steps, np.int64)
    arrays["chunk/end"] = np.asarray(end, np.int8)
    arrays["chunk/eval"] = np.asarray(eval_flags, bool)
    arrays["chunk/final"] = np.zeros(m, bool) if final is None else np.asarray(final, bool)
    if final_obs:
        arrays.update(pack("final_obs", final_obs))
    meta = {"kind": KIND, "batch_id": batch_id, "worker": worker, "task": task}
    return Message(MsgType.TRAJECTORY_CHUNK, meta=meta, arrays=arrays)


def end_code(reason: str | None) -> int:
    return 0 if reason is None else 1 + END_REASONS.index(reason)


def chunk_ids(msg: Message) -> list[tuple[str, int]]:
    """``(chunk_id, num_steps)`` of every chunk in the batch, in order."""
    a, worker = msg.arrays, msg.meta["worker"]
    return [
        (chunk_id(episode_id(worker, e, k), f), n)
        for e, k, f, n in zip(
            a["chunk/env"].tolist(),
            a["chunk/episode"].tolist(),
            a["chunk/first_step"].tolist(),
            a["chunk/num_steps"].tolist(),
        )
    ]


def validate_batch(msg: Message) -> None:
    """Raise :class:`ProtocolError` (BAD_REQUEST) naming what is wrong with a batch."""

    def bad(text: str) -> ProtocolError:
        return ProtocolError(ErrorCode.BAD_REQUEST, f"chunk batch: {text}")

    meta, a = msg.meta, msg.arrays
    for key in ("batch_id", "worker", "task"):
        if not isinstance(meta.get(key), str):
            raise bad(f"meta {key!r} must be a string, got {meta.get(key)!r}")
    missing = [f"chunk/{k}" for k in _PER_CHUNK if f"chunk/{k}" not in a]
    missing += [k for k in ("action", "scalars") if k not in a]
    if missing:
        raise bad(f"arrays {missing} are missing")
    m = len(a["chunk/env"])
    if m < 1 or any(a[f"chunk/{k}"].shape != (m,) for k in _PER_CHUNK):
        raise bad(f"every chunk/* array must have one entry per chunk (>= 1), got {m} chunks")
    n = a["chunk/num_steps"]
    if (n < 1).any() or (a["chunk/first_step"] < 0).any() or (a["chunk/env"] < 0).any():
        raise bad("num_steps must be >= 1, first_step and env >= 0")
    if ((a["chunk/end"] < 0) | (a["chunk/end"] > len(END_REASONS))).any():
        raise bad(f"chunk/end must be 0 (open) or 1 + an index of {END_REASONS}")
    total = int(n.sum())
    obs = unpack("obs", a)
    if not obs:
        raise bad("no obs/* arrays")
    for key, arr in [*((f"obs/{k}", v) for k, v in obs.items()), ("action", a["action"])]:
        if arr.ndim < 1 or arr.shape[0] != total:
            raise bad(f"array {key!r} must have {total} rows (the chunks' steps)")
    if a["scalars"].dtype != np.float64 or a["scalars"].shape != (total, len(STEP_FIELDS)):
        raise bad(f"scalars must be float64[{total}, {len(STEP_FIELDS)}]")
    step = a["scalars"][:, list(STEP_FIELDS).index("step")]
    starts = np.repeat(a["chunk/first_step"] - (np.cumsum(n) - n), n)
    if not np.array_equal(step, starts + np.arange(total)):
        raise bad("step indices must run consecutively from each chunk's first_step")
    final = a["chunk/final"]
    fobs = unpack("final_obs", a)
    if final.any() and (not fobs or any(v.shape[0] != m for v in fobs.values())):
        raise bad(f"chunks flagged chunk/final need final_obs/* arrays with {m} rows")


def select(msg: Message, keep: np.ndarray) -> Message:
    """The batch with only chunks ``keep`` (indices, in order)."""
    a = msg.arrays
    n = a["chunk/num_steps"]
    starts = np.cumsum(n) - n
    rows = np.concatenate([np.arange(s, s + k) for s, k in zip(starts[keep].tolist(), n[keep].tolist())])
    fobs = unpack("final_obs", a)
    return make_batch(
        msg.meta["batch_id"],
        msg.meta["worker"],
        msg.meta["task"],
        obs={k: v[rows] for k, v in unpack("obs", a).items()},
        action=a["action"][rows],
        scalars=a["scalars"][rows],
        **{k: a[f"chunk/{k}"][keep] for k in ("env", "episode", "first_step", "num_steps", "end")},
        eval_flags=a["chunk/eval"][keep],
        final=a["chunk/final"][keep],
        final_obs={k: v[keep] for k, v in fobs.items()} or None,
    )


def expand(msg: Message) -> list[Message]:
    """The batch's chunks as ``TRAJECTORY_CHUNK`` messages (arrays are views of the batch's)."""
    a, worker, task = msg.arrays, msg.meta["worker"], msg.meta["task"]
    obs = unpack("obs", a)
    packed = a["scalars"]
    fields = {k: packed[:, j].astype(dt) for j, (k, dt) in enumerate(STEP_FIELDS.items())}
    fobs = unpack("final_obs", a)
    out = []
    row = 0
    per: dict[str, list[Any]] = {k: a[f"chunk/{k}"].tolist() for k in _PER_CHUNK}
    for i, (env, number, first, n, end, ev, final) in enumerate(zip(*(per[k] for k in _PER_CHUNK))):
        sl = slice(row, row + n)
        row += n
        arrays: dict[str, np.ndarray] = {f"obs/{k}": v[sl] for k, v in obs.items()}
        arrays["action"] = a["action"][sl]
        arrays.update({k: v[sl] for k, v in fields.items()})
        if final:
            arrays.update({f"final_obs/{k}": v[i : i + 1] for k, v in fobs.items()})
        eid = episode_id(worker, env, number)
        reason = END_REASONS[end - 1] if end else None
        meta = {
            "chunk_id": chunk_id(eid, first),
            "episode_id": eid,
            "worker": worker,
            "env": env,
            "task": task,
            "first_step": first,
            "num_steps": n,
            "final": reason is not None,
            "end": reason,
            "eval": bool(ev),
        }
        out.append(Message(MsgType.TRAJECTORY_CHUNK, meta=meta, arrays=arrays))
    return out
