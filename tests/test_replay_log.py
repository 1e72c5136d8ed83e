"""The replay log: deduplication, rebuild, torn tails and retention (in process)."""

from __future__ import annotations

import os
import time

import pytest

from gateway.trajectory import count_chunks
from tests.test_replay_tables import episode_chunks
from trainer.replay.config import ReplayConfig, TableConfig
from trainer.replay.core import ReplayBuffer
from trainer.replay.log import ReplayLog, read_log
from trainer.replay.service import rebuild

pytestmark = pytest.mark.unit


def chunks(n: int = 10):
    return [c for e in range(n) for c in episode_chunks(f"e{e}", 8)]


def test_a_group_is_stored_once_whatever_is_resent(tmp_path):
    log = ReplayLog(tmp_path, fsync="always")
    new, dups = log.append_group(chunks(2))
    assert len(new) == 4 and not dups
    new, dups = log.append_group([*chunks(3), *chunks(1)])
    assert len(new) == 2 and len(dups) == 6
    log.close()
    count = count_chunks(read_log(tmp_path))
    assert count.stored_steps == 24 and count.duplicate_steps == 0


def test_tables_are_rebuilt_from_the_log_after_a_torn_tail(tmp_path):
    log = ReplayLog(tmp_path, fsync="never")
    log.append_group(chunks(5))
    log.close()
    segment = sorted(tmp_path.glob("seg-*.log"))[-1]
    segment.write_bytes(segment.read_bytes()[:-9])  # a write cut short by a crash
    again = ReplayLog(tmp_path)
    assert again.torn_bytes_cut > 0
    buf = ReplayBuffer(
        ReplayConfig(tables=[TableConfig(min_size_to_sample=4, samples_per_insert=2, error_buffer=4)])
    )
    summary = rebuild(again, buffer=buf)
    assert summary["chunks"] == 9 and summary["corrupt_records"] == 0
    assert buf.tables["online"].size == 4 * 8 + 3  # e4's last chunk is gone, its first lacks a next step
    assert buf.tables["online"].limiter.can_sample(1)
    assert len(again.append_group(chunks(5))[0]) == 1  # the resent chunk is stored again, once
    again.close()


def test_retention_deletes_the_oldest_segments_by_size_and_by_age(tmp_path):
    log = ReplayLog(tmp_path, fsync="never", segment_bytes=2000, retention_bytes=6000)
    log.append_group(chunks(10))
    before = log.segments()
    assert len(before) > 4
    assert log.retain() > 0
    after = log.segments()
    assert after == before[-len(after) :] and log.size_bytes() <= 6000 + 2000
    old = log.segments()[0]
    stamp = time.time() - 3600
    os.utime(tmp_path / f"seg-{old:012d}.log", (stamp, stamp))
    log.retention_bytes, log.retention_s = 0, 60.0
    assert log.retain() == 1 and old not in log.segments()
    assert log.segments()[-1] == after[-1]  # the segment being written stays
    log.close()
