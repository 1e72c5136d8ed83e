"""Chunk batches (:mod:`gateway.chunk_batch`): many episodes' chunks as one store record.

The chunks a batch expands to must be the chunks the per-chunk path cuts (ids, arrays,
ends, final observations); the store deduplicates per chunk id, also inside a batch;
a malformed batch is refused with the problem named. Real recorder, spool and episode
store on disk.
"""

from __future__ import annotations

import numpy as np
import pytest

from gateway import chunk_batch
from gateway.env_columns import EnvColumns, EpisodeIds
from gateway.protocol import ProtocolError
from gateway.recorder import Recorder
from gateway.store import EpisodeStore, StoreSink
from gateway.trajectory import Transitions
from tests.test_batched_recorder import Envs, run_steps
from tests.test_recorder import settle

pytestmark = pytest.mark.unit

CHUNK = 4


class PerChunkSink(StoreSink):
    """A store sink that takes chunks one message each (as the replay service's does)."""

    takes_batches = False

    def __init__(self, store: EpisodeStore) -> None:
        super().__init__(store)
        self.batches_seen = 0

    def submit(self, chunk):
        self.batches_seen += chunk_batch.is_batch(chunk)
        super().submit(chunk)


def columns_with_steps(envs: int, steps: int) -> EnvColumns:
    cols = EnvColumns("w0", "reach", num_envs=envs, chunk_steps=CHUNK)
    idx = np.arange(envs)
    cols.start(idx, np.zeros(envs, np.int64), np.zeros(envs, bool))
    for s in range(steps):
        columns = {
            "reward": np.full(envs, s, np.float32),
            "terminated": np.zeros(envs, bool),
            "truncated": np.zeros(envs, bool),
            "success": np.zeros(envs, bool),
            "policy_version": np.ones(envs, np.int64),
            "t_capture": np.full(envs, 1.0),
            "t_action": np.full(envs, 2.0),
            "step": np.full(envs, s, np.int64),
        }
        obs = {"q": (idx[:, None] * 10 + s + np.zeros((envs, 2))).astype(np.float32)}
        batch = Transitions(
            EpisodeIds("w0", idx, np.zeros(envs)), idx, obs, np.zeros((envs, 1), np.float32), columns
        )
        cols.write(idx, batch, segment=1)
    return cols


def test_the_batch_path_and_the_per_chunk_path_store_the_same_chunks(tmp_path):
    stored = {}
    for name, sink_cls in (("batches", StoreSink), ("chunks", PerChunkSink)):
        sink = sink_cls(EpisodeStore(tmp_path / name / "episodes"))
        rec = Recorder(tmp_path / name / "spool", sink, chunk_steps=CHUNK)
        run_steps(rec, Envs(seed=3), 40, lazy=True)
        rec.drain()
        settle(rec)
        assert rec.unacked_chunks == 0
        if sink_cls is PerChunkSink:
            assert sink.batches_seen == 0
        sink.close()
        store = EpisodeStore(tmp_path / name / "episodes", readonly=True)
        stored[name] = {
            c.meta["chunk_id"]: (c.meta, {k: np.asarray(v).tolist() for k, v in c.arrays.items()})
            for c in store.chunks()
        }
        assert store.count().stored_steps == rec.counters.acked_steps
    assert stored["batches"].keys() == stored["chunks"].keys()
    assert stored["batches"] == stored["chunks"]


def test_a_batch_holding_chunks_stored_before_stores_only_the_new_ones(tmp_path):
    store = EpisodeStore(tmp_path / "episodes")
    cols = columns_with_steps(envs=3, steps=3)
    first = cols.cut_batch("b1", np.array([0]), [None])
    assert first is not None
    assert store.put(first[0])
    cols = columns_with_steps(envs=3, steps=3)  # the same steps again (a resend after a restart)
    again = cols.cut_batch("b2", np.arange(3), [None, "interrupted", None])
    assert again is not None
    batch, segments, n = again
    assert n == 9 and segments == {1: 9}
    assert store.put(batch)
    assert not store.put(batch)  # every chunk of it stored now
    store.commit()
    count = store.count()
    assert count.chunks == 3 and count.duplicate_chunks == 0
    assert count.stored_steps == 9 and count.duplicate_steps == 0
    ends = {c.meta["env"]: c.meta["end"] for c in store.chunks()}
    assert ends == {0: None, 1: "interrupted", 2: None}
    store.close()
    reopened = EpisodeStore(tmp_path / "episodes")
    assert not reopened.put(batch)  # the ids inside stored batches are known after a reopen
    reopened.close()


def test_a_batch_whose_rows_do_not_match_its_chunks_is_refused(tmp_path):
    store = EpisodeStore(tmp_path / "episodes")
    cols = columns_with_steps(envs=2, steps=3)
    cut = cols.cut_batch("b1", np.arange(2), [None, None])
    assert cut is not None
    batch = cut[0]
    batch.arrays["chunk/num_steps"] = np.array([2, 3])
    with pytest.raises(ProtocolError, match="must have 5 rows"):
        store.put(batch)
    batch.arrays["chunk/num_steps"] = np.array([3, 3])
    batch.arrays["chunk/first_step"] = np.array([0, 1])
    with pytest.raises(ProtocolError, match="consecutively"):
        store.put(batch)
    store.commit()
    assert store.count().chunks == 0
    store.close()


def test_final_observations_stay_with_their_chunks():
    cols = columns_with_steps(envs=3, steps=2)
    final = {"q": np.array([[7, 7], [8, 8], [9, 9]], np.float32)}
    cut = cols.cut_batch("b1", np.arange(3), ["terminated", "interrupted", "truncated"], final)
    assert cut is not None
    chunks = {c.meta["env"]: c for c in chunk_batch.expand(cut[0])}
    assert chunks[0].arrays["final_obs/q"].tolist() == [[7, 7]]
    assert "final_obs/q" not in chunks[1].arrays
    assert chunks[2].arrays["final_obs/q"].tolist() == [[9, 9]]
    assert [chunks[e].meta["end"] for e in range(3)] == ["terminated", "interrupted", "truncated"]
    assert chunks[1].arrays["obs/q"].tolist() == [[10, 10], [11, 11]]
