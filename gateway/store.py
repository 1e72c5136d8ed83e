"""Trajectory sinks: where the gateway hands finished chunks, and the local episode store.

A :class:`TrajectorySink` takes chunks and later reports which ones it stored durably
(acknowledged). The gateway keeps every step in its spool until the chunk holding it is
acknowledged, so a sink may be slow, restart or refuse for a while without losing data.

:class:`EpisodeStore` is the durable local store under ``<run>/episodes``; it is the
gateway's sink when no replay service runs (:class:`StoreSink`), and the place
``summary.json`` counts ``stored_steps`` from by reading every chunk back::

    store = EpisodeStore(run_dir / "episodes")
    count = store.count()            # StoreCount(stored_steps=..., duplicate_steps=...)
    for episode in store.episodes():
        episode.arrays["obs/joint_pos"]
"""

from __future__ import annotations

import abc
import collections
import logging
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from gateway import chunk_batch
from gateway.protocol import Message
from gateway.segment_log import FsyncPolicy, ReadReport, SegmentLog
from gateway.trajectory import Episode, StoreCount, assemble_episodes, count_chunks, validate_chunk

log = logging.getLogger(__name__)


class TrajectorySink(abc.ABC):
    """Receives trajectory chunks and acknowledges them once durable."""

    @abc.abstractmethod
    def submit(self, chunk: Message) -> None:
        """Hand over a chunk; must not block for long."""

    @abc.abstractmethod
    def poll_acks(self) -> list[str]:
        """Chunk ids stored durably since the last call."""

    takes_batches = False
    """The sink takes chunk batches (:mod:`gateway.chunk_batch`) through :meth:`submit`
    and acknowledges each by its ``batch_id``; otherwise the recorder sends every chunk
    as a message of its own."""

    def backlog(self) -> int:
        """Chunks submitted but not yet acknowledged."""
        return 0

    @property
    def blocked(self) -> bool:
        """True while the sink cannot take more (disk full, consumer behind): the gateway
        stops collecting until it clears; steps already spooled stay safe."""
        return False

    def sockets(self) -> list[Any]:
        """ZeroMQ sockets the gateway's poller should watch for this sink."""
        return []

    def tick(self) -> None:
        """Periodic work (resends, reconnects); called from the gateway loop."""
        return None

    def describe(self) -> str:
        return type(self).__name__

    def bytes_written(self) -> int:
        """Bytes this sink wrote to its own durable log in this process (0: none here)."""
        return 0

    def close(self) -> None:
        return None


class EpisodeStore:
    """A durable local log of trajectory chunks; storing a chunk id twice is a no-op."""

    def __init__(
        self, directory: str | Path, *, fsync: FsyncPolicy = "interval", readonly: bool = False
    ) -> None:
        self.directory = Path(directory)
        self._log = SegmentLog(self.directory, fsync=fsync, readonly=readonly)
        self._ids: set[str] = set()
        if not readonly:
            for _, msg in self._log.read():
                if chunk_batch.is_batch(msg):
                    self._ids.update(cid for cid, _ in chunk_batch.chunk_ids(msg))
                else:
                    self._ids.add(msg.meta["chunk_id"])

    def put(self, chunk: Message) -> bool:
        """Store ``chunk`` (a chunk or a chunk batch) unless its id is stored already; of
        a batch, the chunks not stored yet. Return whether anything was new."""
        if chunk_batch.is_batch(chunk):
            return self._put_batch(chunk)
        validate_chunk(chunk)
        if chunk.meta["chunk_id"] in self._ids:
            return False
        self._log.append(chunk)
        self._ids.add(chunk.meta["chunk_id"])
        return True

    def _put_batch(self, batch: Message) -> bool:
        chunk_batch.validate_batch(batch)
        ids = [cid for cid, _ in chunk_batch.chunk_ids(batch)]
        new = [i for i, cid in enumerate(ids) if cid not in self._ids]
        if not new:
            return False
        if len(new) < len(ids):  # part of it stored before a restart
            batch = chunk_batch.select(batch, np.asarray(new, np.int64))
        self._log.append(batch)
        self._ids.update(ids)
        return True

    def commit(self) -> None:
        self._log.commit()

    @property
    def bytes_written(self) -> int:
        return self._log.bytes_written

    def chunks(self, report: ReadReport | None = None) -> Iterator[Message]:
        """Every stored chunk, oldest first (a batch's chunks one by one)."""
        for _, msg in self._log.read(report=report):
            if chunk_batch.is_batch(msg):
                yield from chunk_batch.expand(msg)
            else:
                yield msg

    def count(self) -> StoreCount:
        return count_chunks(self.chunks())

    def episodes(self) -> list[Episode]:
        return assemble_episodes(list(self.chunks()))

    def close(self) -> None:
        self._log.close()


class StoreSink(TrajectorySink):
    """Writes chunks into an :class:`EpisodeStore` on a thread of its own.

    A chunk of camera frames is megabytes; writing it on the gateway's loop held every
    worker's next action up behind the disk. The thread acknowledges each chunk once
    written; a write the disk refuses (full) is retried every second, and until it
    succeeds the sink reports ``blocked`` so the gateway stops collecting."""

    RETRY_S = 1.0
    takes_batches = True

    def __init__(self, store: EpisodeStore) -> None:
        self.store = store
        self._queue: queue.Queue[Message | None] = queue.Queue()
        self._acked: collections.deque[str] = collections.deque()
        self._submitted = 0
        self._acked_total = 0
        self._error: str | None = None
        self._thread = threading.Thread(target=self._run, name="episode-store", daemon=True)
        self._thread.start()

    def submit(self, chunk: Message) -> None:
        self._submitted += 1
        self._queue.put(chunk)

    def _run(self) -> None:
        while True:
            chunk = self._queue.get()
            if chunk is None:
                break
            while True:
                try:
                    self.store.put(chunk)
                    break
                except OSError as exc:
                    if self._error is None:
                        log.error("episode store refuses writes (%s); collection waits and retries", exc)
                    self._error = str(exc)
                    time.sleep(self.RETRY_S)
            self._error = None
            if self._queue.empty():
                self.store.commit()
            self._acked.append(chunk.meta.get("batch_id") or chunk.meta["chunk_id"])

    def poll_acks(self) -> list[str]:
        acked = []
        while self._acked:
            acked.append(self._acked.popleft())
        self._acked_total += len(acked)
        return acked

    def backlog(self) -> int:
        return self._submitted - self._acked_total - len(self._acked)

    @property
    def blocked(self) -> bool:
        return self._error is not None

    def describe(self) -> str:
        return f"local store {self.store.directory}"

    def bytes_written(self) -> int:
        return self.store.bytes_written

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)
        self.store.close()
