"""The recorder and the local store: exactly-once chunks across restarts."""

from __future__ import annotations

import time

import numpy as np
import pytest

from gateway.recorder import Recorder
from gateway.store import EpisodeStore, StoreSink
from gateway.trajectory import Transitions, assemble_episodes, validate_chunk

pytestmark = pytest.mark.unit


class SilentSink(StoreSink):
    """Stores chunks but never acknowledges them (a replay service that went away)."""

    def poll_acks(self):
        return []


def batch(step, episodes, worker="w1"):
    """``Recorder.record``'s arguments for one step of each of ``episodes``."""
    n = len(episodes)
    steps = Transitions(
        episodes=list(episodes),
        envs=np.arange(n),
        obs={"q": np.full((n, 3), step, np.float32)},
        action=np.full((n, 2), step, np.float32),
        columns=dict(
            reward=np.full(n, -step, np.float32),
            terminated=np.zeros(n, bool),
            truncated=np.zeros(n, bool),
            success=np.zeros(n, bool),
            policy_version=np.zeros(n, np.int64),
            t_capture=np.zeros(n),
            t_action=np.zeros(n),
            step=np.full(n, step, np.int64),
        ),
    )
    return dict(steps=steps, worker=worker, task="reach")


def settle(rec, timeout_s=30.0):
    """Pump until the sink (writing on its own thread) acknowledged every chunk so far."""
    deadline = time.monotonic() + timeout_s
    while True:
        rec.pump()  # submits every ready chunk first
        if rec.unacked_chunks == 0 or time.monotonic() > deadline:
            return
        time.sleep(0.005)


def make(tmp, sink_cls=StoreSink, **kw):
    return Recorder(tmp / "spool", sink_cls(EpisodeStore(tmp / "episodes")), chunk_steps=4, **kw)


def test_chunks_hold_consecutive_steps_and_end_with_the_episode(tmp_path):
    rec = make(tmp_path)
    for s in range(10):
        assert rec.record(**batch(s, ["a", "b"])) == 2
        settle(rec)
    rec.end("a", "truncated", {"q": np.ones(3, np.float32)})
    settle(rec)
    store = EpisodeStore(tmp_path / "episodes", readonly=True)
    chunks = list(store.chunks())
    for c in chunks:
        validate_chunk(c)
    assert [c.meta["first_step"] for c in chunks if c.meta["episode_id"] == "a"] == [0, 4, 8]
    (a,) = [e for e in assemble_episodes(chunks) if e.episode_id == "a"]
    assert a.end == "truncated" and a.num_steps == 10
    np.testing.assert_array_equal(a.arrays["step"], np.arange(10))
    np.testing.assert_array_equal(a.arrays["final_obs/q"], np.ones((1, 3), np.float32))


def test_resent_steps_are_acknowledged_but_stored_once(tmp_path):
    rec = make(tmp_path)
    rec.record(**batch(0, ["a"]))
    rec.record(**batch(1, ["a"]))
    assert rec.record(**batch(1, ["a"])) == 0
    assert rec.counters.duplicate_resends == 1
    rec.end("a", "terminated")
    assert rec.record(**batch(1, ["a"])) == 0  # even after the episode closed
    settle(rec)
    count = EpisodeStore(tmp_path / "episodes", readonly=True).count()
    assert count.stored_steps == 2 and count.duplicate_steps == 0


def test_restart_without_acks_resends_the_same_chunks_and_the_store_dedups(tmp_path):
    rec = make(tmp_path, SilentSink)
    for s in range(10):
        rec.record(**batch(s, ["a", "b"]))
        rec.pump()
    rec.end("a", "truncated")
    rec.pump()
    rec.sink.close()  # its writer stops, as a killed process's would
    # "Crash": the recorder is not closed. A fresh one with an acknowledging sink recovers.
    again = make(tmp_path)
    summary = again.recover()
    assert summary["acked_steps"] == 20 and summary["open_episodes"] == 1
    assert again.record(**batch(9, ["b"])) == 0  # the worker resends its last step
    assert again.record(**batch(10, ["b"])) == 1
    again.drain()
    settle(again)
    count = EpisodeStore(tmp_path / "episodes", readonly=True).count()
    assert count.stored_steps == 21 and count.duplicate_steps == 0
    assert count.completed_episodes == 1 and count.interrupted_episodes == 1


def test_restart_after_acks_across_segments_loses_and_repeats_nothing(tmp_path):
    rec = make(tmp_path, segment_bytes=3000)
    for s in range(30):
        rec.record(**batch(s, ["a", "b", "c"]))
        settle(rec)
    assert len(rec.spool_segments()) < 4  # acknowledged segments are trimmed
    again = make(tmp_path, segment_bytes=3000)
    again.recover()
    for s in range(30, 35):
        again.record(**batch(s, ["a", "b", "c"]))
    again.drain()
    settle(again)
    count = EpisodeStore(tmp_path / "episodes", readonly=True).count()
    assert count.stored_steps == 3 * 35 and count.duplicate_steps == 0
    for episode in EpisodeStore(tmp_path / "episodes", readonly=True).episodes():
        np.testing.assert_array_equal(episode.arrays["step"], np.arange(35))


def test_interrupting_a_worker_keeps_its_steps(tmp_path):
    rec = make(tmp_path)
    for s in range(3):
        rec.record(**batch(s, ["a"], worker="w1"))
        rec.record(**batch(s, ["z"], worker="w2"))
    assert rec.interrupt("w1") == 1
    settle(rec)
    assert set(rec.open) == {"z"}
    (a,) = EpisodeStore(tmp_path / "episodes", readonly=True).episodes()
    assert a.end == "interrupted" and a.num_steps == 3


def test_store_refuses_malformed_chunks(tmp_path):
    from gateway.protocol import Message, MsgType, ProtocolError

    store = EpisodeStore(tmp_path / "episodes")
    with pytest.raises(ProtocolError, match="chunk_id"):
        store.put(Message(MsgType.TRAJECTORY_CHUNK, meta={"episode_id": "a"}))
