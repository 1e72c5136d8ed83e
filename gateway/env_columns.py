"""The open episodes of one env worker as columns: the recorder's path at thousands of envs.

A worker with ``K`` envs reports ``K`` steps per message. Keeping one Python object per
episode and appending to it row by row costs a Python loop over ``K`` on every step; at
4096 envs that loop, not the disk, was what bounded the gateway. Here the per-env state
is a handful of arrays and the steps of each env's open chunk sit in ring buffers with
one slot per step of a chunk, so a batch is written with one fancy-indexed assignment
per array, whatever ``K`` is::

    cols = EnvColumns("w0", "reach", num_envs=4096, chunk_steps=64)
    dup = cols.duplicates(envs, numbers, step)       # bool[k]: re-sent steps
    cols.start(envs[new], numbers[new], eval_flags)  # envs whose episode begins now
    cols.write(envs, steps, segment)                 # one batch, vectorised
    [(chunk, segments, n)] = cols.cut_many(envs[:1], [None])  # env's held steps as a chunk

Per-episode work (cutting a chunk on a ``chunk_steps`` boundary, closing an episode) is
a loop over the envs concerned only, which is ``K / chunk_steps`` per step on average.
Episode ids are built from numbers only where a chunk or an end needs one
(:class:`EpisodeIds`). The recorder (:mod:`gateway.recorder`) decides what is new, writes
the spool first, and uses this for the bookkeeping; recovery after a restart goes
through its per-episode path and is adopted here when the worker's next batch arrives.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, overload

import numpy as np

from gateway import chunk_batch
from gateway.protocol import Message, MsgType
from gateway.trajectory import STEP_FIELDS, StepRows, Transitions, chunk_id, episode_id


class EpisodeIds(Sequence[str]):
    """The episode ids of a batch's rows (``"<worker>-<env>-<n>"``), made only when read."""

    __slots__ = ("envs", "numbers", "worker")

    def __init__(self, worker: str, envs: np.ndarray, numbers: np.ndarray) -> None:
        self.worker = worker
        self.envs = np.asarray(envs, dtype=np.int64)
        self.numbers = np.asarray(numbers, dtype=np.int64)
        if self.envs.shape != self.numbers.shape:
            raise ValueError(f"envs {self.envs.shape} and numbers {self.numbers.shape} differ in shape")

    def __len__(self) -> int:
        return len(self.numbers)

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return episode_id(self.worker, int(self.envs[i]), int(self.numbers[i]))

    def __iter__(self) -> Iterator[str]:
        for env, number in zip(self.envs.tolist(), self.numbers.tolist()):
            yield episode_id(self.worker, env, number)

    def select(self, idx: np.ndarray) -> EpisodeIds:
        return EpisodeIds(self.worker, self.envs[idx], self.numbers[idx])


def split_episode_id(episode: str) -> tuple[str, int, int] | None:
    """``(worker, env, number)`` of an id made by :func:`~gateway.trajectory.episode_id`."""
    worker, _, rest = episode.rpartition("-")
    worker, _, env = worker.rpartition("-")
    if not worker or not env.isdigit() or not rest.isdigit():
        return None
    return worker, int(env), int(rest)


def select_rows(steps: Transitions, idx: np.ndarray) -> Transitions:
    """Rows ``idx`` of a batch whose ids are :class:`EpisodeIds` (kept lazy)."""
    assert isinstance(steps.episodes, EpisodeIds)
    return Transitions(
        steps.episodes.select(idx),
        steps.envs[idx],
        {k: v[idx] for k, v in steps.obs.items()},
        steps.action[idx],
        {k: np.asarray(v)[idx] for k, v in steps.columns.items()},
    )


class EnvColumns:
    """Per-env episode state and the held steps of each env's open chunk, as arrays."""

    def __init__(self, worker: str, task: str, *, num_envs: int, chunk_steps: int) -> None:
        self.worker, self.task, self.chunk_steps = worker, task, chunk_steps
        self.n = 0
        self.episode = np.zeros(0, np.int64)
        """Number of each env's latest episode seen here (-1: none yet)."""
        self.open = np.zeros(0, bool)
        """That episode is open."""
        self.next_step = np.zeros(0, np.int64)
        self.first = np.zeros(0, np.int64)
        """Step index of the first held step."""
        self.pos = np.zeros(0, np.int64)
        """Steps held (the open chunk so far); slot ``i`` of the rings holds its step ``i``."""
        self.eval = np.zeros(0, bool)
        self.segments = np.zeros((0, chunk_steps), np.int64)
        """Spool segment of each held step (trimming waits for the chunk's acknowledgement)."""
        self.obs: dict[str, np.ndarray] = {}
        self.action: np.ndarray | None = None
        self.scalars = np.zeros((0, chunk_steps, len(STEP_FIELDS)), np.float64)
        """The step fields packed as in the spool record (one assignment per batch, not one per field)."""
        self.grow(num_envs)

    # --------------------------------------------------------------- storage

    def grow(self, num_envs: int) -> None:
        """Room for envs ``0 .. num_envs - 1`` (a worker never shrinks)."""
        if num_envs <= self.n:
            return
        extra = num_envs - self.n

        def widen(a: np.ndarray, fill: Any, axis: int) -> np.ndarray:
            shape = list(a.shape)
            shape[axis] = extra
            return np.concatenate([a, np.full(shape, fill, a.dtype)], axis=axis)

        self.episode = widen(self.episode, -1, 0)
        self.open = widen(self.open, False, 0)
        self.next_step = widen(self.next_step, 0, 0)
        self.first = widen(self.first, 0, 0)
        self.pos = widen(self.pos, 0, 0)
        self.eval = widen(self.eval, False, 0)
        self.segments = widen(self.segments, 0, 0)
        self.obs = {k: widen(v, 0, 0) for k, v in self.obs.items()}
        self.action = None if self.action is None else widen(self.action, 0, 0)
        self.scalars = widen(self.scalars, 0, 0)
        self.n = num_envs

    def _ring(self, like: np.ndarray) -> np.ndarray:
        # Env-major: an env's held steps are contiguous, so cutting its chunk is one slice.
        return np.zeros((self.n, self.chunk_steps, *like.shape[1:]), like.dtype)

    # ------------------------------------------------------------- batch path

    def known(self, envs: np.ndarray) -> np.ndarray:
        """bool[k]: envs whose episodes this table has seen (the others are checked by
        the recorder against its closed episodes: they may be re-sends after a restart)."""
        known: np.ndarray = self.episode[envs] >= 0
        return known

    def duplicates(self, envs: np.ndarray, numbers: np.ndarray, step: np.ndarray) -> np.ndarray:
        """bool[k]: steps recorded already (an older episode, a closed one, an earlier step)."""
        mine = self.episode[envs]
        same = numbers == mine
        dup: np.ndarray = (mine >= 0) & (
            (numbers < mine) | (same & (~self.open[envs] | (step < self.next_step[envs])))
        )
        return dup

    def start(self, envs: np.ndarray, numbers: np.ndarray, eval_flags: np.ndarray) -> None:
        """Envs ``envs`` begin episodes ``numbers`` (their previous ones are closed)."""
        self.episode[envs] = numbers
        self.open[envs] = True
        self.pos[envs] = 0
        self.eval[envs] = eval_flags

    def write(
        self, envs: np.ndarray, steps: Transitions, segment: int, packed: np.ndarray | None = None
    ) -> None:
        """Append row ``i`` of ``steps`` to env ``envs[i]``'s open chunk, all rows at once
        (``packed``: its step fields as :meth:`Transitions.spool_arrays` packs them)."""
        slot = self.pos[envs]
        if np.count_nonzero(slot >= self.chunk_steps):
            raise AssertionError("a chunk outgrew chunk_steps: a boundary cut was missed")
        step = np.asarray(steps.columns["step"], np.int64)
        starting = slot == 0
        self.first[envs[starting]] = step[starting]
        flat = envs * self.chunk_steps + slot  # rows of the rings seen as [n * chunk_steps, ...]
        for key, value in steps.obs.items():
            ring = self.obs.get(key)
            if ring is None:
                ring = self.obs[key] = self._ring(value)
            _rows(ring)[flat] = value
        if self.action is None:
            self.action = self._ring(steps.action)
        _rows(self.action)[flat] = steps.action
        if packed is None:
            packed = steps.spool_arrays()["scalars"]
        _rows(self.scalars)[flat] = packed
        _rows(self.segments)[flat] = segment
        self.pos[envs] = slot + 1
        self.next_step[envs] = step + 1

    def boundary(self, envs: np.ndarray, step: np.ndarray) -> np.ndarray:
        """bool[k]: envs whose held steps end a chunk before ``step`` (another block)."""
        c = self.chunk_steps
        cross: np.ndarray = (self.pos[envs] > 0) & (step // c != self.first[envs] // c)
        return cross

    # --------------------------------------------------------------- per env

    def episode_id(self, env: int) -> str:
        return episode_id(self.worker, env, int(self.episode[env]))

    def cut_many(
        self,
        envs: np.ndarray,
        ends: Sequence[str | None],
        final_obs: Mapping[str, np.ndarray] | None = None,
    ) -> list[tuple[Message, Counter[int], int]]:
        """Each env's held steps as a chunk (``ends[i]``: the episode of ``envs[i]`` ends
        with it; ``final_obs`` rows in ``envs``' order), the spool segments they came from
        and their number, in that order; the envs hold none afterwards. Envs holding as
        many steps are gathered with one copy per array; each chunk's arrays are views of it."""
        envs = np.asarray(envs, np.int64)
        out: list[tuple[Message, Counter[int], int] | None] = [None] * len(envs)
        held = self.pos[envs]
        assert self.action is not None or not held.any()
        for p in np.unique(held).tolist():
            group = np.flatnonzero(held == p)
            idx = envs[group]
            # One gather per array: [g, p, ...], each env's rows one contiguous block.
            obs = {k: v[idx, :p] for k, v in self.obs.items()}
            action = None if self.action is None else self.action[idx, :p]
            scalars = self.scalars[idx, :p]
            fields = {k: scalars[:, :, j].astype(dt) for j, (k, dt) in enumerate(STEP_FIELDS.items())}
            segs = self.segments[idx, :p]
            one_segment = (segs.min(axis=1) == segs.max(axis=1)) if p else np.ones(len(idx), bool)
            for j, (g, env) in enumerate(zip(group.tolist(), idx.tolist())):
                arrays: dict[str, np.ndarray] = {f"obs/{k}": v[j] for k, v in obs.items()}
                arrays["action"] = action[j] if action is not None else np.zeros((0,), np.float32)
                arrays.update({k: v[j] for k, v in fields.items()})
                if final_obs is not None and ends[g] in ("terminated", "truncated"):
                    arrays.update({f"final_obs/{k}": np.asarray(v[g])[None] for k, v in final_obs.items()})
                eid, first, end = self.episode_id(env), int(self.first[env]), ends[g]
                meta = {
                    "chunk_id": chunk_id(eid, first),
                    "episode_id": eid,
                    "worker": self.worker,
                    "env": env,
                    "task": self.task,
                    "first_step": first,
                    "num_steps": p,
                    "final": end is not None,
                    "end": end,
                    "eval": bool(self.eval[env]),
                }
                if not p:
                    segments: Counter[int] = Counter()
                elif one_segment[j]:
                    segments = Counter()
                    segments[int(segs[j, 0])] = p  # cheaper than Counter({...})
                else:
                    segments = Counter(segs[j].tolist())
                out[g] = (Message(MsgType.TRAJECTORY_CHUNK, meta=meta, arrays=arrays), segments, p)
        self.pos[envs] = 0
        return [o for o in out if o is not None]

    def cut_batch(
        self,
        batch_id: str,
        envs: np.ndarray,
        ends: Sequence[str | None],
        final_obs: Mapping[str, np.ndarray] | None = None,
    ) -> tuple[Message, Counter[int], int] | None:
        """What :meth:`cut_many` cuts, as one :mod:`~gateway.chunk_batch` message (one
        gather per array, no loop over the chunks): the batch, the spool segments its
        steps came from and their number; None when no env of ``envs`` holds steps."""
        envs = np.asarray(envs, np.int64)
        held = self.pos[envs]
        sel = np.flatnonzero(held > 0)
        if not len(sel):
            self.pos[envs] = 0
            return None
        idx, n = envs[sel], held[sel]
        total = int(n.sum())
        starts = np.cumsum(n) - n
        flat = np.repeat(idx * self.chunk_steps - starts, n) + np.arange(total)
        assert self.action is not None
        codes = np.array([chunk_batch.end_code(ends[j]) for j in sel.tolist()], np.int8)
        final = fobs = None
        if final_obs:
            final = np.isin(codes, [chunk_batch.end_code("terminated"), chunk_batch.end_code("truncated")])
            fobs = {k: np.asarray(v)[sel] for k, v in final_obs.items()}
        batch = chunk_batch.make_batch(
            batch_id,
            self.worker,
            self.task,
            obs={k: _rows(v)[flat] for k, v in self.obs.items()},
            action=_rows(self.action)[flat],
            scalars=_rows(self.scalars)[flat],
            env=idx,
            episode=self.episode[idx],
            first_step=self.first[idx],
            num_steps=n,
            end=codes,
            eval_flags=self.eval[idx],
            final=final,
            final_obs=fobs,
        )
        segs = _rows(self.segments)[flat]
        lo = int(segs.min())
        segments: Counter[int] = Counter()
        if lo == int(segs.max()):
            segments[lo] = total
        else:
            values, counts = np.unique(segs, return_counts=True)
            segments.update(dict(zip(values.tolist(), counts.tolist())))
        self.pos[envs] = 0
        return batch, segments, total

    def adopt(self, env: int, number: int, rows: StepRows, next_step: int, segments: list[int]) -> None:
        """Take over an open episode rebuilt by the recorder's recovery (its held steps all
        lie in one chunk block, so they fit the rings)."""
        self.grow(env + 1)
        n = len(rows)
        self.episode[env], self.open[env], self.eval[env] = number, True, rows.eval
        self.next_step[env], self.pos[env] = next_step, 0
        if not n:
            return
        obs = {k: np.stack(v) for k, v in rows.obs.items()}
        columns = {k: np.asarray(rows.scalars[k], dtype=STEP_FIELDS[k]) for k in STEP_FIELDS}
        batch = Transitions([rows.episode_id] * n, np.full(n, env), obs, np.stack(rows.action), columns)
        for i in range(n):  # one episode's few held steps, once after a restart
            self.write(np.array([env]), select_rows_plain(batch, i), segments[i])
        self.next_step[env] = next_step

    def open_ids(self) -> dict[str, int]:
        """Open episodes and their next step index (the recorder's snapshot)."""
        return {self.episode_id(e): int(self.next_step[e]) for e in np.flatnonzero(self.open).tolist()}

    def held_steps(self) -> int:
        return int(self.pos.sum())


def _rows(ring: np.ndarray) -> np.ndarray:
    """A ring ``[n, chunk_steps, ...]`` as ``[n * chunk_steps, ...]`` (a view)."""
    return ring.reshape(-1, *ring.shape[2:])


def select_rows_plain(steps: Transitions, i: int) -> Transitions:
    """Row ``i`` of a batch as a batch of one."""
    idx = np.array([i])
    return Transitions(
        [steps.episodes[i]],
        steps.envs[idx],
        {k: v[idx] for k, v in steps.obs.items()},
        steps.action[idx],
        {k: np.asarray(v)[idx] for k, v in steps.columns.items()},
    )
