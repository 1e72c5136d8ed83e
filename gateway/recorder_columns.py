"""The recorder's batch path: a worker's whole batch recorded without a loop over its envs.

:class:`~gateway.recorder.Recorder` takes this mixin. A batch whose ids are
:class:`~gateway.env_columns.EpisodeIds` (what the gateway builds from a worker's
observation) is recorded here: duplicates found with array comparisons, one spool record
(``kind: "batch"``: the per-episode ids travel as a worker name and two int64 arrays, not
as thousands of strings), and the steps written into the worker's
:class:`~gateway.env_columns.EnvColumns`. Episode ends of one observation are one spool
record too (``kind: "ends"``). Everything durable is the same as on the per-episode path
(:meth:`Recorder.recover` reads both record kinds back through it), so a restart, the
sink, chunk ids and chunk boundaries do not tell the two paths apart.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from gateway.env_columns import EnvColumns, EpisodeIds, select_rows, split_episode_id
from gateway.protocol import Message, MsgType, pack
from gateway.trajectory import Transitions

CLOSED_MEMORY = 16384
"""Recently closed episodes remembered to recognise re-sent final steps (a few per env
of the largest workers)."""


class ColumnRecording:
    """Batch recording for :class:`~gateway.recorder.Recorder` (which supplies the state below)."""

    counters: Any
    interventions: Any
    chunk_steps: int
    open: dict[str, Any]
    closed: OrderedDict[str, int]
    _inflight: dict[str, tuple[str, Counter[int], int]]
    _ready: list[Message]
    _batches: dict[str, Message]
    _batch_prefix: str
    _batch_seq: int
    sink: Any
    _seg_unacked: Counter[int]
    _pending: list[tuple[Mapping[str, Any], Transitions, int]]
    _append: Callable[[Message], Any]
    _bookkeeping: Callable[[Message], None]
    _is_duplicate: Callable[[str, int], bool]
    apply_pending: Callable[[], None]
    columns: dict[str, EnvColumns]

    # ------------------------------------------------------------------ record

    def _table(self, worker: str, task: str, envs: np.ndarray) -> EnvColumns:
        """``worker``'s table, made on its first batch; open episodes the recovery rebuilt
        for it are adopted then."""
        need = int(envs.max()) + 1 if len(envs) else 0
        cols = self.columns.get(worker)
        if cols is None:
            cols = self.columns[worker] = EnvColumns(
                worker, task, num_envs=need, chunk_steps=self.chunk_steps
            )
            for episode in [e for e, ep in self.open.items() if ep.rows.worker == worker]:
                ep, parts = self.open.pop(episode), split_episode_id(episode)
                if parts is None:  # not an id this gateway made: keep it on the other path
                    self.open[episode] = ep
                    continue
                cols.adopt(parts[1], parts[2], ep.rows, ep.next_step, ep.segments)
        cols.grow(need)
        return cols

    def _record_batch(self, steps: Transitions, worker: str, task: str, eval_flags: Any) -> int:
        ids = steps.episodes
        assert isinstance(ids, EpisodeIds)
        cols = self._table(worker, task, ids.envs)
        step = np.asarray(steps.columns["step"], np.int64)
        dup = cols.duplicates(ids.envs, ids.numbers, step)
        unknown = (~cols.known(ids.envs)).nonzero()[0]
        for i in unknown.tolist():  # first batch after a restart: closed episodes by id
            dup[i] = self._is_duplicate(ids[i], int(step[i]))
        flags = np.zeros(len(steps), bool) if eval_flags is None else np.asarray(eval_flags, bool)
        if np.count_nonzero(dup):
            keep = (~dup).nonzero()[0]
            self.counters.duplicate_resends += len(steps) - len(keep)
            if not len(keep):
                return 0
            steps, flags = select_rows(steps, keep), flags[keep]
            ids = steps.episodes
            assert isinstance(ids, EpisodeIds)
        meta = {
            "kind": "batch",
            "worker": worker,
            "task": task,
            "eval": flags.tolist() if np.count_nonzero(flags) else [],
        }
        arrays = {**steps.spool_arrays(), "episode": ids.numbers}
        pos = self._append(Message(MsgType.TRAJECTORY_CHUNK, meta=meta, arrays=arrays))
        applied = {"kind": "batch", "worker": worker, "flags": flags, "packed": arrays["scalars"]}
        self._pending.append((applied, steps, pos.segment))
        return len(steps)

    def _apply_batch(self, meta: Mapping[str, Any], steps: Transitions, segment: int) -> None:
        ids = steps.episodes
        assert isinstance(ids, EpisodeIds)
        cols = self.columns[meta["worker"]]
        envs, numbers = ids.envs, ids.numbers
        step = np.asarray(steps.columns["step"], np.int64)
        # A newer episode in an env whose episode is still open: that one was cut short.
        stale = envs[cols.open[envs] & (numbers > cols.episode[envs])]
        if len(stale):
            self._end_envs(cols, stale, ["interrupted"] * len(stale))
        same = cols.open[envs] & (numbers == cols.episode[envs])
        crossing = envs[same & cols.boundary(envs, step)]
        if len(crossing):
            self._cut_envs(cols, crossing, [None] * len(crossing))
        fresh = ~same
        if np.count_nonzero(fresh):  # most steps continue their episodes: no new ones to start
            cols.start(envs[fresh], numbers[fresh], meta["flags"][fresh])
        cols.write(envs, steps, segment, meta.get("packed"))
        n = len(steps)
        self._seg_unacked[segment] += n
        self.counters.acked_steps += n
        flagged = steps.columns.get("intervention")
        if flagged is not None and hasattr(self.counters, "intervention_steps"):
            k = int(np.count_nonzero(flagged))
            self.counters.intervention_steps += k
            self.interventions.add(n, k)

    # ------------------------------------------------------------------ chunks

    def _take_chunks(self, chunks: list[tuple[Message, Counter[int], int]]) -> None:
        for chunk, segments, n in chunks:
            self._inflight[chunk.meta["chunk_id"]] = (chunk.meta["episode_id"], segments, n)
            self._ready.append(chunk)

    def _cut_envs(
        self,
        cols: EnvColumns,
        envs: np.ndarray,
        ends: Sequence[str | None],
        final_obs: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """The held steps of ``envs`` as chunks for the sink: one chunk batch
        (:mod:`gateway.chunk_batch`) when the sink takes them, else one message each."""
        if not self.sink.takes_batches:
            self._take_chunks(cols.cut_many(envs, ends, final_obs))
            return
        self._batch_seq += 1
        cut = cols.cut_batch(f"{self._batch_prefix}-{self._batch_seq}", envs, ends, final_obs)
        if cut is None:
            return
        batch, segments, n = cut
        bid = batch.meta["batch_id"]
        self._inflight[bid] = ("", segments, n)
        self._batches[bid] = batch
        self._ready.append(batch)

    def _end_envs(
        self,
        cols: EnvColumns,
        envs: np.ndarray,
        reasons: list[str],
        final_obs: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Close the open episodes of ``envs`` (their held steps become final chunks)."""
        interrupted = sum(1 for r in reasons if r == "interrupted")
        self.counters.episodes_interrupted += interrupted
        self.counters.episodes_ended += len(reasons) - interrupted
        holding = np.flatnonzero(cols.pos[envs] > 0)
        if len(holding):
            rows = {k: np.asarray(v)[holding] for k, v in final_obs.items()} if final_obs else None
            self._cut_envs(cols, envs[holding], [reasons[j] for j in holding.tolist()], rows)
        cols.open[envs] = False
        for env in envs.tolist():
            self.closed[cols.episode_id(env)] = int(cols.next_step[env])
        while len(self.closed) > CLOSED_MEMORY:
            self.closed.popitem(last=False)

    def end_many(
        self,
        worker: str,
        envs: np.ndarray,
        numbers: np.ndarray,
        reasons: list[str],
        final_obs: Mapping[str, np.ndarray] | None = None,
    ) -> int:
        """Close episode ``numbers[i]`` of env ``envs[i]`` of ``worker`` for ``reasons[i]``
        (``final_obs``: rows [k, ...] in the same order), with one spool record; episodes
        not open here are skipped. Returns how many closed."""
        self.apply_pending()
        cols = self.columns.get(worker)
        if cols is None:  # the worker's batches never came through here (a restart)
            ids = EpisodeIds(worker, envs, numbers)
            done = 0
            end: Callable[..., None] = self.end  # type: ignore[attr-defined]
            for j, episode in enumerate(ids):
                if episode in self.open:
                    end(episode, reasons[j], {k: v[j] for k, v in (final_obs or {}).items()} or None)
                    done += 1
            return done
        envs = np.asarray(envs, np.int64)
        valid = envs < cols.n
        sel = np.flatnonzero(valid)
        sel = sel[cols.open[envs[sel]] & (cols.episode[envs[sel]] == np.asarray(numbers)[sel])]
        if not len(sel):
            return 0
        episodes = [cols.episode_id(int(e)) for e in envs[sel].tolist()]
        why = [reasons[j] for j in sel.tolist()]
        arrays = pack("final_obs", {k: np.asarray(v)[sel] for k, v in final_obs.items()}) if final_obs else {}
        # Saves work after a restart only: a refused write (disk full) leaves the ends to
        # the final chunks, as on the per-episode path.
        self._bookkeeping(
            Message(
                MsgType.TRAJECTORY_CHUNK,
                meta={"kind": "ends", "episodes": episodes, "reasons": why},
                arrays=arrays,
            )
        )
        rows = {k: np.asarray(v)[sel] for k, v in final_obs.items()} if final_obs else None
        self._end_envs(cols, envs[sel], why, rows)
        return len(sel)

    def end_column_episode(
        self, episode: str, reason: str, final_obs: Mapping[str, np.ndarray] | None
    ) -> bool:
        """Close ``episode`` if a worker's table holds it open (:meth:`Recorder.end`)."""
        parts = split_episode_id(episode)
        cols = self.columns.get(parts[0]) if parts else None
        if parts is None or cols is None or parts[1] >= cols.n:
            return False
        _, env, number = parts
        if not (cols.open[env] and cols.episode[env] == number):
            return False
        fo = {k: np.asarray(v)[None] for k, v in final_obs.items()} if final_obs else None
        self.end_many(parts[0], np.array([env]), np.array([number]), [reason], fo)
        return True

    def interrupt_columns(self, worker: str | None) -> int:
        """Close every open episode in the tables (of ``worker``, or all) as interrupted."""
        closed = 0
        for uid, cols in list(self.columns.items()):
            if worker is not None and uid != worker:
                continue
            envs = np.flatnonzero(cols.open)
            closed += self.end_many(uid, envs, cols.episode[envs], ["interrupted"] * len(envs))
        return closed

    # ------------------------------------------------------------------ state

    def column_open_ids(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for cols in self.columns.values():
            out.update(cols.open_ids())
        return out

    def column_open_count(self) -> int:
        return sum(int(cols.open.sum()) for cols in self.columns.values())

    def column_workers(self) -> set[str]:
        return {uid for uid, cols in self.columns.items() if cols.open.any()}

    def column_held_steps(self) -> int:
        return sum(cols.held_steps() for cols in self.columns.values())


def batch_from_spool(
    meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
) -> tuple[list[str], list[bool]]:
    """Episode ids and eval flags of a ``batch`` spool record, for the recovery."""
    ids = list(EpisodeIds(meta["worker"], np.asarray(arrays["env"]), np.asarray(arrays["episode"])))
    flags = list(meta.get("eval") or [False] * len(ids))
    return ids, flags
