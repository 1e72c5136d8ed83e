"""The replay service's durable log: every accepted chunk, once, in checksummed segments.

A :class:`~gateway.segment_log.SegmentLog` under ``<run>/replay/log``; each record is a
trajectory chunk as it arrived, plus ``meta["source"]`` (``online`` or ``demos``). The
service appends a group of chunks, commits once (fsync per ``replay.fsync``) and only
then acknowledges them, so an acknowledged chunk is in the log. Chunk ids seen are
kept, so a chunk sent twice is stored once. On restart the tables are rebuilt by
reading the log; a torn tail is cut on open and a corrupted record is reported and
skipped (the rest of its segment and the other segments are read). Retention deletes
whole segments, oldest first, by total size or by age::

    log = ReplayLog(run_dir / "replay" / "log", fsync="always")
    new = log.append_group(chunks)     # the ones not seen before; durable on return
    for chunk in log.chunks():         # oldest first
        ...
    count = count_store(cfg, run_dir)  # what summary.json reports, read from the log
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from gateway.protocol import Message
from gateway.segment_log import FsyncPolicy, Position, ReadReport, SegmentLog
from gateway.store import EpisodeStore
from gateway.trajectory import StoreCount, count_chunks

log = logging.getLogger(__name__)

LOG_DIR = Path("replay") / "log"
"""Where a run keeps the replay log, relative to the run folder."""
INDEXED_EPISODES = 100_000
"""Most recent episodes whose chunks' places in the log are remembered (:meth:`ReplayLog.episode_chunks`)."""


class ReplayLog:
    """Append-only, deduplicated chunk log with group commit and retention."""

    def __init__(
        self,
        directory: str | Path,
        *,
        fsync: FsyncPolicy = "always",
        fsync_interval_s: float = 0.5,
        segment_bytes: int = 64 << 20,
        retention_bytes: int = 0,
        retention_s: float = 0.0,
    ) -> None:
        self.directory = Path(directory)
        self._log = SegmentLog(
            self.directory, fsync=fsync, fsync_interval_s=fsync_interval_s, segment_bytes=segment_bytes
        )
        self.retention_bytes = retention_bytes
        self.retention_s = retention_s
        self.ids: set[str] = set()
        self.report = ReadReport()
        self.appended = 0
        self.duplicates = 0
        self.syncs = 0
        self.deleted_segments = 0
        self._where: OrderedDict[str, list[tuple[int, int, Position]]] = OrderedDict()

    def _index(self, msg: Message, pos: Position) -> None:
        episode = str(msg.meta.get("episode_id"))
        first, n = int(msg.meta.get("first_step", 0)), int(msg.meta.get("num_steps", 0))
        self._where.setdefault(episode, []).append((first, n, pos))
        self._where.move_to_end(episode)
        if len(self._where) > INDEXED_EPISODES:
            self._where.popitem(last=False)

    def episode_chunks(self, episode_id: str, first: int = 0, last: int | None = None) -> list[Message]:
        """The stored chunks of a recent episode (:data:`INDEXED_EPISODES`) holding any of
        steps ``first..last`` (None: to its end), read back from where they are in the
        log; chunks of deleted segments are gone."""
        out = []
        for start, n, pos in list(self._where.get(episode_id, [])):
            if start + n <= first or (last is not None and start > last):
                continue
            records = self._log.read(start=pos)
            try:
                at, msg = next(records)
            except StopIteration:
                continue
            finally:
                records.close()
            if at == pos and msg.meta.get("episode_id") == episode_id:
                out.append(msg)
        return out

    @property
    def torn_bytes_cut(self) -> int:
        return self._log.torn_bytes_cut

    def chunks(self, report: ReadReport | None = None) -> Iterator[Message]:
        """Every chunk in the log, oldest first; remembers their ids for deduplication."""
        for pos, msg in self._log.read(report=report if report is not None else self.report):
            self.ids.add(msg.meta["chunk_id"])
            self._index(msg, pos)
            yield msg

    def append_group(self, chunks: Iterable[Message]) -> tuple[list[Message], list[Message]]:
        """Append the chunks not stored yet, then commit once: ``(new, duplicates)``.

        Raises ``OSError`` (``ENOSPC``, ``EDQUOT``, ``EFBIG``, ``EIO``) when the disk refuses;
        chunks of the group appended before the failure are durable but not
        acknowledged, so the gateway resends them and they are recognised as duplicates.
        """
        new: list[Message] = []
        dups: list[Message] = []
        group: set[str] = set()
        for chunk in chunks:
            cid = chunk.meta["chunk_id"]
            if cid in self.ids or cid in group:
                dups.append(chunk)
                continue
            self._index(chunk, self._log.append(chunk))
            group.add(cid)
            new.append(chunk)
            # Only now is it on disk: a failure above must not mark it as stored.
            self.ids.add(cid)
        # Duplicates may be records a failed group left uncommitted: commit them too.
        if (
            (new or dups)
            and self._log.fsync != "never"
            and self._log.commit(force=self._log.fsync == "always")
        ):
            self.syncs += 1
        self.appended += len(new)
        self.duplicates += len(dups)
        return new, dups

    def retain(self) -> int:
        """Apply retention (size, then age); return the number of segments deleted."""
        deleted = 0
        segments = self._log.segments()
        current = self._log.current_segment
        if self.retention_bytes:
            sizes = {s: _size(self._log.path(s)) for s in segments}
            total = sum(sizes.values())
            for seg in segments:
                if total <= self.retention_bytes or seg == current:
                    break
                total -= sizes[seg]
                self._log.delete_segment(seg)
                deleted += 1
        if self.retention_s:
            horizon = time.time() - self.retention_s
            for seg in self._log.segments():
                if seg == current:
                    break
                path = self._log.path(seg)
                if path.exists() and path.stat().st_mtime < horizon:
                    self._log.delete_segment(seg)
                    deleted += 1
        if deleted:
            log.info("retention deleted %d segment(s)", deleted)
        self.deleted_segments += deleted
        return deleted

    def size_bytes(self) -> int:
        # Read from the service loop while the ingest thread may delete segments.
        return sum(_size(self._log.path(s)) for s in self._log.segments())

    def segments(self) -> list[int]:
        return self._log.segments()

    def state(self) -> dict[str, Any]:
        return {
            "chunks": len(self.ids),
            "appended": self.appended,
            "duplicates": self.duplicates,
            "syncs": self.syncs,
            "bytes": self.size_bytes(),
            "segments": len(self.segments()),
            "deleted_segments": self.deleted_segments,
            "corrupt_records": self.report.corrupt_records,
            "corrupt_segments": list(self.report.corrupt_segments),
            "torn_bytes_cut": self.torn_bytes_cut,
        }

    def close(self) -> None:
        self._log.close()


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def read_log(directory: str | Path, report: ReadReport | None = None) -> Iterator[Message]:
    """Chunks of a replay log without opening it for writing (no tail is cut)."""
    for _, msg in SegmentLog(directory, readonly=True).read(report=report):
        yield msg


def run_chunks(run_dir: str | Path, report: ReadReport | None = None) -> Iterator[Message]:
    """Every stored chunk of a run: its replay log if it has one, else its episode store."""
    run = Path(run_dir)
    if (run / LOG_DIR).is_dir():
        yield from read_log(run / LOG_DIR, report)
    elif (run / "episodes").is_dir():
        yield from EpisodeStore(run / "episodes", readonly=True).chunks(report)
    else:
        raise FileNotFoundError(f"{run} has neither {LOG_DIR} nor episodes/: not a run folder with data")


def count_store(cfg: Any, run_dir: str | Path) -> StoreCount:
    """``STORE_READERS["replay"]``: steps and duplicates read back from the replay log.

    Demonstrations imported into the run are not steps of this run: they are left out.
    """
    chunks = (m for m in read_log(Path(run_dir) / LOG_DIR) if m.meta.get("source", "online") == "online")
    return count_chunks(chunks)
