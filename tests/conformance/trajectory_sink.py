"""Conformance suite for trajectory sinks: the contract of ``gateway.store.TrajectorySink``.

The gateway hands a sink the chunks it cuts (``StepRows.to_chunk``) and trims its spool
only for the ids the sink acknowledges, so every sink must: acknowledge each chunk once
it is durable, store a chunk submitted twice once, say ``blocked`` while it cannot take
more and count its ``backlog()``, read back what it acknowledged, and close twice
without harm. A sink proves it by subclassing :class:`TrajectorySinkConformance`::

    class TestMySinkConformance(TrajectorySinkConformance):
        @pytest.fixture
        def sink_under_test(self, tmp_path):
            sink = MySink(tmp_path)
            yield SinkUnderTest(sink, read_back=lambda: list(MyStore(tmp_path).chunks()))
            sink.close()

``SinkUnderTest.blocking`` is a context manager that makes the sink's consumer refuse
or fall behind for real (a full disk, a stopped service) and lets it recover on exit;
a sink whose consumer cannot be blocked leaves it None and the blocking test is skipped.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest

from gateway.protocol import Message
from gateway.store import TrajectorySink
from gateway.trajectory import StepRows, count_chunks
from tests.conftest import time_left, wait_for


@dataclass
class SinkUnderTest:
    """A sink, how to read its durable store back, and how to block its consumer."""

    sink: TrajectorySink
    read_back: Callable[[], list[Message]]
    """Every chunk the durable store holds, read from the store itself (not the sink)."""
    blocking: Callable[[], contextlib.AbstractContextManager[None]] | None = None
    """Within it, the consumer refuses or falls behind; on exit it recovers."""


def episode_chunks(episode_id: str, steps: int, per_chunk: int, *, end: str = "truncated") -> list[Message]:
    """Chunks of one episode, cut as the gateway cuts them; ``obs/q`` and ``action`` hold the step."""
    rows = StepRows(episode_id, "w0", 0, "reach")
    for s in range(steps):
        last = s == steps - 1
        rows.add(
            {"q": np.full(3, s, np.float32)},
            np.full(2, s, np.float32),
            reward=float(-s),
            terminated=last and end == "terminated",
            truncated=last and end == "truncated",
            success=False,
            policy_version=3,
            t_capture=1_700_000_000.0 + s * 0.05,
            t_action=1_700_000_000.0 + s * 0.05 + 0.001,
            step=s,
        )
    chunks = []
    while len(rows):
        head = rows.take(per_chunk)
        final = not len(rows)
        final_obs = {"q": np.full(3, steps, np.float32)} if final else None
        chunks.append(head.to_chunk(end=end if final else None, final_obs=final_obs))
    return chunks


def ids(chunks: Iterable[Message]) -> set[str]:
    return {c.meta["chunk_id"] for c in chunks}


@pytest.mark.conformance
class TrajectorySinkConformance:
    """Tests every trajectory sink passes; subclasses supply the ``sink_under_test`` fixture."""

    per_chunk: ClassVar[int] = 4
    """Steps per chunk in these tests."""
    block_chunks: ClassVar[int] = 4
    """Chunks submitted while the consumer is blocked (more than a bounded sink's backlog)."""

    @pytest.fixture
    def sink_under_test(self) -> SinkUnderTest:
        raise NotImplementedError

    # ------------------------------------------------------------- helpers

    def episode(self, steps: int = 10, **kw: str) -> list[Message]:
        """Chunks of a fresh episode (ids unique across tests sharing one store)."""
        return episode_chunks(f"ep-{uuid.uuid4().hex[:10]}", steps, self.per_chunk, **kw)

    @staticmethod
    def pump(sink: TrajectorySink, want: set[str], what: str = "acknowledgements") -> list[str]:
        """Tick the sink as the gateway loop does until every id in ``want`` is acknowledged;
        return every acknowledgement seen, in order."""
        got: list[str] = []

        def done() -> bool:
            sink.tick()
            got.extend(sink.poll_acks())
            return want <= set(got)

        wait_for(done, timeout=time_left(), interval=0.005, what=f"{len(want)} {what}")
        return got

    @staticmethod
    def mine(stored: Iterable[Message], want: set[str]) -> list[Message]:
        return [c for c in stored if c.meta["chunk_id"] in want]

    # ---------------------------------------------------------------- tests

    def test_every_chunk_is_acknowledged_once_durable_and_reads_back(self, sink_under_test) -> None:
        sink = sink_under_test.sink
        assert sink.backlog() == 0 and not sink.blocked
        chunks = self.episode(10) + self.episode(7, end="terminated")
        for chunk in chunks:
            sink.submit(chunk)
        assert 0 <= sink.backlog() <= len(chunks)
        acked = self.pump(sink, ids(chunks))
        assert len(acked) == len(chunks), f"acknowledgements {acked} for {len(chunks)} chunks"
        assert sink.backlog() == 0 and not sink.blocked
        assert sink.poll_acks() == [], "an acknowledgement was reported twice"
        stored = {c.meta["chunk_id"]: c for c in self.mine(sink_under_test.read_back(), ids(chunks))}
        assert stored.keys() == ids(chunks), "an acknowledged chunk is not in the store"
        for chunk in chunks:
            back = stored[chunk.meta["chunk_id"]]
            assert back.arrays.keys() == chunk.arrays.keys()
            for key, value in chunk.arrays.items():
                np.testing.assert_array_equal(back.arrays[key], value, err_msg=f"{key} read back differs")
                assert back.arrays[key].dtype == value.dtype
            for key in ("episode_id", "first_step", "num_steps", "final", "end"):
                assert back.meta[key] == chunk.meta[key], f"meta {key!r} read back differs"

    def test_a_chunk_submitted_twice_is_stored_once(self, sink_under_test) -> None:
        sink = sink_under_test.sink
        chunks = self.episode(8)
        for chunk in chunks:
            sink.submit(chunk)
        sink.submit(chunks[0])  # before its acknowledgement
        self.pump(sink, ids(chunks))
        # After its acknowledgement (a gateway restarted from its spool resubmits): the
        # resubmitted chunk is acknowledged again, so the spool can be trimmed.
        sink.submit(chunks[1])
        self.pump(sink, {chunks[1].meta["chunk_id"]}, "acknowledgement of a resubmitted chunk")
        wait_for(lambda: sink.backlog() == 0, timeout=time_left(), what="an empty backlog")
        count = count_chunks(self.mine(sink_under_test.read_back(), ids(chunks)))
        assert count.duplicate_chunks == 0 and count.duplicate_steps == 0
        assert count.chunks == len(chunks) and count.stored_steps == 8

    def test_a_blocked_consumer_shows_as_blocked_and_backlog_then_everything_is_acknowledged(
        self, sink_under_test
    ) -> None:
        if sink_under_test.blocking is None:
            pytest.skip("this sink's consumer cannot be blocked for real here")
        sink = sink_under_test.sink
        chunks = [c for _ in range(self.block_chunks) for c in self.episode(self.per_chunk)]
        with sink_under_test.blocking():
            for chunk in chunks:
                sink.submit(chunk)

            def blocked() -> bool:
                sink.tick()
                assert sink.poll_acks() == [], "a chunk was acknowledged while its consumer was blocked"
                return sink.blocked

            wait_for(blocked, timeout=time_left(), what="the sink to report blocked")
            assert sink.backlog() == len(chunks)
        self.pump(sink, ids(chunks), "acknowledgements once the consumer recovered")
        wait_for(lambda: not sink.blocked, timeout=time_left(), what="the sink to clear blocked")
        assert sink.backlog() == 0
        count = count_chunks(self.mine(sink_under_test.read_back(), ids(chunks)))
        assert count.chunks == len(chunks) and count.duplicate_chunks == 0

    def test_close_is_idempotent_and_what_was_acknowledged_stays_readable(self, sink_under_test) -> None:
        sink = sink_under_test.sink
        chunks = self.episode(6)
        for chunk in chunks:
            sink.submit(chunk)
        self.pump(sink, ids(chunks))
        sink.close()
        sink.close()
        assert ids(self.mine(sink_under_test.read_back(), ids(chunks))) == ids(chunks)
