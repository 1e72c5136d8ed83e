"""The recorder: steps in, durable acknowledged chunks out; nothing lost, nothing twice.

The gateway calls :meth:`Recorder.record` with the transitions a worker's message
completed. They are written to the spool (a :class:`~gateway.segment_log.SegmentLog`)
*before* the gateway acknowledges them to the worker, so an acknowledged step is on
disk even if the gateway is killed the next instant. Steps are grouped per episode
into chunks of ``chunk_steps`` (episode ends flush early) and handed to the sink; a
spool segment is deleted once every step in it is in a chunk the sink acknowledged.

Spool records (``meta["kind"]``):

- ``steps``: a batch of transitions (arrays with one row per step, ``meta["episodes"]``);
- ``batch``: a worker's batch (:mod:`gateway.recorder_columns`): the same arrays plus
  ``episode`` (int64 per row), ``meta["worker"]`` instead of per-row ids;
- ``end``: an episode ended (``reason``, optional ``final_obs/*``); ``ends``: several
  (``meta["episodes"]``, ``meta["reasons"]``, ``final_obs/*`` rows in that order);
- ``acked``: chunks the sink stored (``[[chunk_id, num_steps], ...]``);
- ``snapshot``: first record of every segment after the first: open episodes and
  their next step index, recently closed ones, counters.

:meth:`Recorder.recover` rebuilds everything from the spool after a restart; re-sent
steps (``step`` below an episode's next index) are acknowledged again but stored once.
Chunk boundaries are deterministic (a chunk never spans a multiple of ``chunk_steps``
in step index), so a chunk re-sent after a restart has the same id and the sink
deduplicates it.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gateway import chunk_batch
from gateway.env_columns import EpisodeIds
from gateway.metrics import Histogram
from gateway.protocol import Message, MsgType, pack, unpack
from gateway.recorder_columns import CLOSED_MEMORY, ColumnRecording, batch_from_spool
from gateway.segment_log import FsyncPolicy, SegmentLog
from gateway.store import TrajectorySink
from gateway.trajectory import StepRows, Transitions

log = logging.getLogger(__name__)


@dataclass
class OpenEpisode:
    rows: StepRows
    next_step: int
    segments: list[int] = field(default_factory=list)
    end: str | None = None
    final_obs: dict[str, np.ndarray] | None = None


@dataclass
class RecorderCounters:
    acked_steps: int = 0
    """Unique steps written to the spool (and acknowledged to workers)."""
    duplicate_resends: int = 0
    """Steps re-sent by workers after a reconnect that were already recorded."""
    episodes_ended: int = 0
    episodes_interrupted: int = 0
    chunks_submitted: int = 0
    chunks_acked: int = 0
    intervention_steps: int = 0
    """Of ``acked_steps``, those whose action came from a takeover (``intervention``)."""

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)

    def status(self, recent: InterventionRate) -> dict[str, Any]:
        """The step counters of the gateway's status (and ``metrics.jsonl``)."""
        return {
            "acked_steps": self.acked_steps,
            "duplicate_resends": self.duplicate_resends,
            "intervention_steps": self.intervention_steps,
            "intervention_rate": round(recent.rate(), 4),
        }


class InterventionRate:
    """The share of intervention steps among the last ``window`` steps recorded."""

    def __init__(self, window: int = 1000) -> None:
        self.window = window
        self._batches: deque[tuple[int, int]] = deque()
        self._steps = self._flagged = 0

    def add(self, steps: int, flagged: int) -> None:
        self._batches.append((steps, flagged))
        self._steps += steps
        self._flagged += flagged
        while len(self._batches) > 1 and self._steps - self._batches[0][0] >= self.window:
            n, k = self._batches.popleft()
            self._steps -= n
            self._flagged -= k

    def rate(self) -> float:
        return self._flagged / self._steps if self._steps else 0.0


class Recorder(ColumnRecording):
    """Per-episode chunking in front of a sink, with a write-ahead spool; a worker's
    batches go through its :class:`~gateway.env_columns.EnvColumns` (no loop per env)."""

    def __init__(
        self,
        spool_dir: str | Path,
        sink: TrajectorySink,
        *,
        chunk_steps: int = 64,
        fsync: FsyncPolicy = "interval",
        fsync_interval_s: float = 1.0,
        segment_bytes: int = 64 << 20,
    ) -> None:
        self.sink = sink
        self.chunk_steps = chunk_steps
        self.counters = RecorderCounters()
        self.interventions = InterventionRate()
        """The intervention rate over the last steps recorded (``intervention_rate``)."""
        self.open: dict[str, OpenEpisode] = {}
        self.columns = {}
        self.closed: OrderedDict[str, int] = OrderedDict()
        self._inflight: dict[str, tuple[str, Counter[int], int]] = {}
        self._seg_unacked: Counter[int] = Counter()
        # The recorder rolls segments itself so each new one starts with a snapshot.
        self.segment_bytes = segment_bytes
        self._spool = SegmentLog(
            spool_dir, fsync=fsync, fsync_interval_s=fsync_interval_s, segment_bytes=1 << 62
        )
        self._ready: list[Message] = []
        self._batches: dict[str, Message] = {}
        """Chunk batches submitted and not acknowledged yet, by batch id (their chunk ids
        go into the ``acked`` record once the sink stores them)."""
        self._batch_prefix = f"b{uuid.uuid4().hex[:12]}"
        self._batch_seq = 0
        self.spool_error: str | None = None
        """Why the last spool write failed (e.g. "No space left on device"), until one succeeds."""
        self.ack_latency = Histogram()
        """µs from a chunk's submission to the sink to its acknowledgement (the ``sink_ack`` hop)."""
        self._submitted_at: dict[str, float] = {}
        self._pending: list[tuple[Mapping[str, Any], Transitions, int]] = []
        self._cutting = True
        self._oldest_segment: int | None = None
        """The oldest spool segment left after the last trim (None: not looked yet)."""

    # ------------------------------------------------------------------ record

    def record(
        self, steps: Transitions, *, worker: str, task: str, eval_flags: list[bool] | None = None
    ) -> int:
        """Spool a batch of transitions of ``worker`` (evaluation rows flagged in ``eval_flags``).

        Returns the number of new steps; re-sent ones are skipped. When this returns the
        steps are durable against this process dying (see ``SegmentLog.append``).
        """
        self.apply_pending()  # deduplication below needs every earlier record applied
        if isinstance(steps.episodes, EpisodeIds):
            return self._record_batch(steps, worker, task, eval_flags)
        index = steps.columns["step"]
        keep = [i for i, ep in enumerate(steps.episodes) if not self._is_duplicate(ep, int(index[i]))]
        self.counters.duplicate_resends += len(steps) - len(keep)
        if not keep:
            return 0
        if len(keep) != len(steps):
            steps = steps.select(keep)
            eval_flags = [eval_flags[i] for i in keep] if eval_flags else None
        meta = {
            "kind": "steps",
            "worker": worker,
            "task": task,
            "episodes": steps.episodes,
            "eval": eval_flags or [],
        }
        pos = self._append(Message(MsgType.TRAJECTORY_CHUNK, meta=meta, arrays=steps.spool_arrays()))
        # Chunking is bookkeeping in memory: the caller may acknowledge first and apply
        # afterwards (apply_pending), keeping it out of the observation->action path.
        self._pending.append((meta, steps, pos.segment))
        return len(steps)

    def apply_pending(self) -> None:
        """Fold spooled but not yet applied step records into the open episodes."""
        while self._pending:
            meta, steps, segment = self._pending.pop(0)
            self._apply_steps(meta, steps, segment)

    def _is_duplicate(self, episode: str, step: int) -> bool:
        if episode in self.closed:
            return True
        ep = self.open.get(episode)
        return ep is not None and step < ep.next_step

    def _apply_steps(self, meta: Mapping[str, Any], steps: Transitions, segment: int) -> None:
        if meta.get("kind") == "batch" and isinstance(steps.episodes, EpisodeIds):
            self._apply_batch(meta, steps, segment)
            return
        eval_flags = meta.get("eval") or [False] * len(steps)
        index, flagged = steps.columns["step"], steps.columns["intervention"]
        before = self.counters.acked_steps, self.counters.intervention_steps
        for i, episode in enumerate(steps.episodes):
            step = int(index[i])
            if self._is_duplicate(episode, step):
                continue
            ep = self.open.get(episode)
            if ep is None:
                rows = StepRows(
                    episode, meta["worker"], int(steps.envs[i]), meta["task"], bool(eval_flags[i])
                )
                ep = self.open[episode] = OpenEpisode(rows, next_step=step)
            block = step // self.chunk_steps
            if self._cutting and len(ep.rows) and block != ep.rows.first_step // self.chunk_steps:
                self._cut(ep, len(ep.rows))
            obs, action, scalars = steps.row(i)
            ep.rows.add(obs, action, **scalars)
            ep.segments.append(segment)
            ep.next_step = step + 1
            self._seg_unacked[segment] += 1
            self.counters.acked_steps += 1
            self.counters.intervention_steps += bool(flagged[i])
        c = self.counters
        self.interventions.add(c.acked_steps - before[0], c.intervention_steps - before[1])

    def end(self, episode: str, reason: str, final_obs: Mapping[str, np.ndarray] | None = None) -> None:
        """Close an episode (``terminated``, ``truncated`` or ``interrupted``) and flush it."""
        self.apply_pending()
        ep = self.open.get(episode)
        if ep is None:
            self.end_column_episode(episode, reason, final_obs)
            return
        arrays = (
            pack("final_obs", {k: np.asarray(v)[None] for k, v in final_obs.items()}) if final_obs else {}
        )
        # An end the spool cannot take (disk full) is still cut into the episode's final
        # chunk for the sink; only a restart before the disk frees up would see it open.
        self._bookkeeping(
            Message(
                MsgType.TRAJECTORY_CHUNK,
                meta={"kind": "end", "episode": episode, "reason": reason},
                arrays=arrays,
            )
        )
        self._close(episode, reason, final_obs)

    def _close(self, episode: str, reason: str, final_obs: Mapping[str, np.ndarray] | None) -> None:
        ep = self.open.pop(episode)
        if reason == "interrupted":
            self.counters.episodes_interrupted += 1
        else:
            self.counters.episodes_ended += 1
        if len(ep.rows):
            ep.end, ep.final_obs = reason, dict(final_obs) if final_obs else None
            self._cut(ep, len(ep.rows))
        self.closed[episode] = ep.next_step
        while len(self.closed) > CLOSED_MEMORY:
            self.closed.popitem(last=False)

    def flush(self, next_obs: Mapping[str, Mapping[str, np.ndarray]] | None = None) -> int:
        """Cut every open episode's held steps into a chunk now (not a final one): the
        end of an on-policy round, so the sink gets every step collected so far.

        ``next_obs[worker][key]`` [K, ...] is the observation each env of ``worker`` waits
        in (its last step's next one): it travels with the chunk as ``boot_obs/<key>``
        [1, ...], so the last step can bootstrap. A ``flush`` spool record comes first:
        a restart cuts the same chunks again (same ids). Returns the steps cut; raises
        ``OSError`` (and cuts nothing) if the spool refuses the record."""
        self.apply_pending()
        self._append(Message(MsgType.TRAJECTORY_CHUNK, meta={"kind": "flush"}))
        boot = next_obs or {}
        cut = 0
        for ep in list(self.open.values()):
            if not len(ep.rows):
                continue
            cut += len(ep.rows)
            env, rows = ep.rows.env, boot.get(ep.rows.worker)
            self._cut(ep, len(ep.rows))
            if rows:
                self._ready[-1].arrays.update(_boot(rows, env))
        for uid, cols in self.columns.items():
            envs = np.flatnonzero(cols.open & (cols.pos > 0))
            if not len(envs):
                continue
            cut += int(cols.pos[envs].sum())
            chunks = cols.cut_many(envs, [None] * len(envs))
            waiting = boot.get(uid)
            if waiting:
                for chunk, _, _ in chunks:
                    chunk.arrays.update(_boot(waiting, chunk.meta["env"]))
            self._take_chunks(chunks)
        return cut

    def interrupt(self, worker: str | None = None) -> int:
        """Close every open episode (of ``worker``, or all) as interrupted; keep their steps."""
        self.apply_pending()
        victims = [e for e, ep in self.open.items() if worker is None or ep.rows.worker == worker]
        for episode in victims:
            self.end(episode, "interrupted")
        return len(victims) + self.interrupt_columns(worker)

    def open_workers(self) -> set[str]:
        self.apply_pending()
        return {ep.rows.worker for ep in self.open.values()} | self.column_workers()

    def open_episodes(self) -> int:
        """Episodes open now (on either path)."""
        self.apply_pending()
        return len(self.open) + self.column_open_count()

    # ------------------------------------------------------------------ chunks

    def _cut(self, ep: OpenEpisode, n: int) -> None:
        final = n == len(ep.rows) and ep.end is not None
        head = ep.rows.take(n)
        segs = Counter(ep.segments[:n])
        ep.segments = ep.segments[n:]
        chunk = head.to_chunk(end=ep.end if final else None, final_obs=ep.final_obs if final else None)
        self._inflight[chunk.meta["chunk_id"]] = (chunk.meta["episode_id"], segs, n)
        self._ready.append(chunk)

    def pump(self) -> int:
        """Submit ready chunks, collect acknowledgements, trim the spool; return acks seen."""
        self.apply_pending()
        ready, self._ready = self._ready, []
        for chunk in ready:
            bid = chunk.meta.get("batch_id")
            self._submitted_at.setdefault(bid or chunk.meta["chunk_id"], time.perf_counter())
            self.sink.submit(chunk)
            self.counters.chunks_submitted += len(chunk.arrays["chunk/env"]) if bid else 1
        acked = self.sink.poll_acks()
        entries: list[Any] = []
        for cid in acked:
            entry = self._inflight.pop(cid, None)
            if entry is None:
                continue  # a duplicate ack of a re-sent chunk
            submitted = self._submitted_at.pop(cid, None)
            if submitted is not None:
                self.ack_latency.add((time.perf_counter() - submitted) * 1e6)
            _, segs, n = entry
            self._seg_unacked.subtract(segs)
            batch = self._batches.pop(cid, None)
            if batch is None:
                entries.append([cid, n])
                self.counters.chunks_acked += 1
            else:  # the restart's bookkeeping knows chunks, not batches
                ids = chunk_batch.chunk_ids(batch)
                entries += [[c, k] for c, k in ids]
                self.counters.chunks_acked += len(ids)
        if entries:
            # Without this record a restart resends those chunks, which the sink stores once.
            self._bookkeeping(Message(MsgType.TRAJECTORY_CHUNK, meta={"kind": "acked", "chunks": entries}))
            self._trim()
        return len(entries)

    @property
    def unacked_chunks(self) -> int:
        return len(self._inflight)

    def undelivered_steps(self) -> int:
        """Acknowledged steps the sink has not stored yet: safe in the spool, and
        delivered from it on the next start if this process ends first."""
        self.apply_pending()
        held = sum(len(ep.rows) for ep in self.open.values()) + self.column_held_steps()
        return sum(n for _, _, n in self._inflight.values()) + held

    def _append(self, msg: Message) -> Any:
        """Write a record; an ``OSError`` (disk full) is recorded in :attr:`spool_error`
        and raised, a success clears it."""
        try:
            if self._spool.current_size > self.segment_bytes:
                self._roll_with_snapshot()
            pos = self._spool.append(msg)
            self._spool.commit()
        except OSError as exc:
            if self.spool_error is None:
                log.error("the spool cannot write: %s; collection holds until it can", exc)
            self.spool_error = exc.strerror or str(exc)
            raise
        if self.spool_error is not None:
            log.info("the spool writes again (after: %s)", self.spool_error)
            self.spool_error = None
        return pos

    def _bookkeeping(self, msg: Message) -> None:
        """A record that only saves work after a restart (an episode end, acknowledged
        chunks): a refused write is logged and the run goes on."""
        with contextlib.suppress(OSError):
            self._append(msg)

    def _trim(self) -> None:
        """Delete the oldest segments while every step in them is acknowledged."""
        current = self._spool.current_segment
        oldest = self._oldest_segment
        if oldest is not None and (oldest >= current or self._seg_unacked[oldest] > 0):
            return  # nothing to delete: no need to list the spool (every pump with acks asks)
        self._oldest_segment = current
        for seg in self._spool.segments():
            if seg >= current or self._seg_unacked[seg] > 0:
                self._oldest_segment = seg
                break
            self._spool.delete_segment(seg)
            self._seg_unacked.pop(seg, None)

    def _roll_with_snapshot(self) -> None:
        self._spool.roll()
        snapshot = {
            "kind": "snapshot",
            "open": {**{e: ep.next_step for e, ep in self.open.items()}, **self.column_open_ids()},
            "closed": dict(self.closed),
            "counters": self.counters.to_dict(),
        }
        self._spool.append(Message(MsgType.TRAJECTORY_CHUNK, meta=snapshot))
        self._spool.commit()
        self._trim()

    @property
    def spool_bytes(self) -> int:
        """Bytes written to the spool by this process."""
        return self._spool.bytes_written

    def spool_segments(self) -> list[int]:
        return self._spool.segments()

    # ---------------------------------------------------------------- recovery

    def recover(self) -> dict[str, int]:
        """Rebuild open episodes and unacknowledged chunks from the spool."""
        pending_ends: dict[str, tuple[str, dict[str, np.ndarray] | None]] = {}
        acked: dict[str, int] = {}
        splits: dict[str, set[int]] = {}
        first = True
        records = 0
        for pos, msg in self._spool.read():
            records += 1
            kind = msg.meta.get("kind")
            if kind == "snapshot":
                if first:
                    for e, nxt in msg.meta["open"].items():
                        self.open[e] = OpenEpisode(StepRows(e, "", 0, ""), next_step=int(nxt))
                    self.closed.update({e: int(n) for e, n in msg.meta["closed"].items()})
                    for k, v in msg.meta["counters"].items():
                        setattr(self.counters, k, int(v))
            elif kind == "steps":
                arrays = {k: np.array(v) for k, v in msg.arrays.items()}
                self._apply_steps_recovering(
                    msg.meta, Transitions.from_spool(msg.meta["episodes"], arrays), pos.segment
                )
            elif kind == "batch":
                arrays = {k: np.array(v) for k, v in msg.arrays.items()}
                ids, _ = batch_from_spool(msg.meta, arrays)
                self._apply_steps_recovering(msg.meta, Transitions.from_spool(ids, arrays), pos.segment)
            elif kind == "ends":
                final = unpack("final_obs", msg.arrays)
                for j, (episode, reason) in enumerate(zip(msg.meta["episodes"], msg.meta["reasons"])):
                    pending_ends[episode] = (reason, {k: np.array(v[j]) for k, v in final.items()} or None)
            elif kind == "end":
                final = unpack("final_obs", msg.arrays)
                pending_ends[msg.meta["episode"]] = (
                    msg.meta["reason"],
                    {k: np.array(v[0]) for k, v in final.items()} or None,
                )
            elif kind == "acked":
                for cid, n in msg.meta["chunks"]:
                    acked[cid] = int(n)
            elif kind == "flush":  # every open episode's held steps were cut here
                self.apply_pending()
                for e, ep in self.open.items():
                    if len(ep.rows):
                        splits.setdefault(e, set()).add(ep.next_step)
            first = False
        # Drop acknowledged steps, then re-cut chunks on the same boundaries as before.
        acked_ranges: dict[str, list[tuple[int, int]]] = {}
        for cid, n in acked.items():
            episode, _, start = cid.rpartition(":")
            acked_ranges.setdefault(episode, []).append((int(start), int(start) + n))
        for episode, ep in self.open.items():
            ranges = acked_ranges.get(episode, [])
            steps = [int(s) for s in ep.rows.scalars["step"]]
            keep = [i for i, s in enumerate(steps) if not any(a <= s < b for a, b in ranges)]
            gone = [ep.segments[i] for i in range(len(steps)) if i not in set(keep)]
            self._seg_unacked.subtract(Counter(gone))
            ep.rows = ep.rows.select(keep)
            ep.segments = [ep.segments[i] for i in keep]
            # Every complete block but the newest becomes a chunk again, cut where a
            # flush cut it before.
            cuts = sorted(splits.get(episode, ()))
            while len(ep.rows):
                lo, hi = ep.rows.first_step, int(ep.rows.scalars["step"][-1])
                block = lo // self.chunk_steps
                size = sum(1 for s in ep.rows.scalars["step"] if int(s) // self.chunk_steps == block)
                flushed = [s - lo for s in cuts if lo < s <= hi + 1 and s - lo <= size]
                if flushed:
                    size = flushed[0]
                elif hi // self.chunk_steps == block:
                    break
                self._cut(ep, size)
        for episode, (reason, final_obs) in pending_ends.items():
            if episode in self.open:
                self._close(episode, reason, final_obs)
        # Snapshot placeholders for episodes with no steps left and no worker to return.
        for e in [e for e, ep in self.open.items() if not ep.rows.worker]:
            self.closed[e] = self.open.pop(e).next_step
        summary = {
            "records": records,
            "open_episodes": len(self.open),
            "chunks_to_resend": len(self._ready),
            "acked_steps": self.counters.acked_steps,
        }
        log.info("spool recovered: %s", summary)
        return summary

    def _apply_steps_recovering(self, meta: Mapping[str, Any], steps: Transitions, segment: int) -> None:
        # A snapshot placeholder (no worker yet) takes the worker, env and task of its
        # first step record; episodes keep counting from the snapshot's next_step.
        for i, episode in enumerate(steps.episodes):
            ep = self.open.get(episode)
            if ep is not None and not ep.rows.worker:
                ep.rows = StepRows(episode, meta["worker"], int(steps.envs[i]), meta["task"])
        self._cutting = False  # cut after acks are applied, not while replaying
        try:
            self._apply_steps(meta, steps, segment)
        finally:
            self._cutting = True

    # -------------------------------------------------------------------- end

    def drain(self) -> None:
        """Interrupt open episodes and submit everything (the caller waits for acks)."""
        self.interrupt()
        self.pump()

    def close(self) -> None:
        self._spool.close()


def _boot(next_obs: Mapping[str, np.ndarray], env: int) -> dict[str, np.ndarray]:
    """Env ``env``'s row of ``next_obs`` as a chunk's ``boot_obs/*`` [1, ...] (copied: a
    worker's observation may sit in a shared-memory ring it reuses)."""
    return pack("boot_obs", {k: np.asarray(v)[[env]] for k, v in next_obs.items()})
