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
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
            self._ids = {msg.meta["chunk_id"] for msg in self.chunks()}

    def put(self, chunk: Message) -> bool:
        """Store ``chunk`` unless its id is stored already; return whether it was new."""
        validate_chunk(chunk)
        if chunk.meta["chunk_id"] in self._ids:
            return False
        self._log.append(chunk)
        self._ids.add(chunk.meta["chunk_id"])
        return True

    def commit(self) -> None:
        self._log.commit()

    def chunks(self, report: ReadReport | None = None) -> Iterator[Message]:
        for _, msg in self._log.read(report=report):
            yield msg

    def count(self) -> StoreCount:
        return count_chunks(self.chunks())

    def episodes(self) -> list[Episode]:
        return assemble_episodes(list(self.chunks()))

    def close(self) -> None:
        self._log.close()


class StoreSink(TrajectorySink):
    """Writes chunks into an :class:`EpisodeStore` and acknowledges them at once."""

    def __init__(self, store: EpisodeStore) -> None:
        self.store = store
        self._acked: list[str] = []

    def submit(self, chunk: Message) -> None:
        self.store.put(chunk)
        self._acked.append(chunk.meta["chunk_id"])

    def poll_acks(self) -> list[str]:
        if not self._acked:
            return []
        self.store.commit()
        acked, self._acked = self._acked, []
        return acked

    def describe(self) -> str:
        return f"local store {self.store.directory}"

    def close(self) -> None:
        self.store.close()
