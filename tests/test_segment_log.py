"""The segment log: durable appends, torn tails cut, corruption reported and skipped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from gateway.protocol import Message, MsgType
from gateway.segment_log import ReadReport, SegmentLog

pytestmark = pytest.mark.unit


def record(i: int, size: int = 50) -> Message:
    return Message(MsgType.TRAJECTORY_CHUNK, seq=i, meta={"i": i}, arrays={"x": np.full(size, i, np.float32)})


def fill(path, n=30, segment_bytes=2000):
    log = SegmentLog(path, segment_bytes=segment_bytes, fsync="never")
    for i in range(n):
        log.append(record(i))
    log.close()
    return log


def read_all(path):
    report = ReadReport()
    seqs = [m.seq for _, m in SegmentLog(path, readonly=True).read(report=report)]
    return seqs, report


def test_records_come_back_in_order_across_segments(tmp_path):
    log = fill(tmp_path)
    assert len(log.segments()) > 3
    seqs, report = read_all(tmp_path)
    assert seqs == list(range(30)) and report.corrupt_records == 0


def test_torn_tail_is_cut_on_open_and_appends_continue(tmp_path):
    log = fill(tmp_path)
    last = log.path(log.segments()[-1])
    data = last.read_bytes()
    last.write_bytes(data[:-7])
    reopened = SegmentLog(tmp_path)
    assert reopened.torn_bytes_cut > 0
    reopened.append(record(99))
    reopened.close()
    seqs, report = read_all(tmp_path)
    assert seqs == [*range(29), 99] and report.corrupt_records == 0


def test_flipped_bytes_are_reported_and_other_segments_survive(tmp_path):
    log = fill(tmp_path)
    victim = log.path(log.segments()[1])
    data = bytearray(victim.read_bytes())
    data[60] ^= 0xFF
    victim.write_bytes(bytes(data))
    seqs, report = read_all(tmp_path)
    assert report.corrupt_records == 1 and report.corrupt_segments == [log.segments()[1]]
    assert len(seqs) == 29  # exactly the damaged record is lost
    assert seqs == sorted(seqs)


def test_deleting_a_segment_keeps_the_rest(tmp_path):
    log = SegmentLog(tmp_path, segment_bytes=2000, fsync="never")
    for i in range(30):
        log.append(record(i))
    first = log.segments()[0]
    log.delete_segment(first)
    with pytest.raises(ValueError):
        log.delete_segment(log.current_segment)
    log.close()
    seqs, _ = read_all(tmp_path)
    assert seqs and seqs[0] > 0 and seqs == list(range(seqs[0], 30))


def test_appended_records_survive_sigkill_of_the_writer(tmp_path):
    """A writer killed mid-stream loses nothing it finished appending."""
    script = textwrap.dedent(
        f"""
        import sys, numpy as np
        sys.path.insert(0, {str(os.getcwd())!r})
        from gateway.segment_log import SegmentLog
        from gateway.protocol import Message, MsgType
        log = SegmentLog({str(tmp_path)!r}, fsync="never", segment_bytes=1 << 16)
        i = 0
        while True:
            log.append(Message(MsgType.TRAJECTORY_CHUNK, seq=i, arrays={{"x": np.full(3000, i, np.float32)}}))
            print(i, flush=True)
            i += 1
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    acked = -1
    assert proc.stdout is not None
    for line in proc.stdout:
        acked = int(line)
        if acked >= 300:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    SegmentLog(tmp_path).close()  # reopening cuts a torn tail, if any
    seqs, report = read_all(tmp_path)
    assert report.corrupt_records == 0
    assert seqs[: acked + 1] == list(range(acked + 1))


def test_under_fsync_interval_a_roll_and_a_deletion_never_wait_for_the_disk(tmp_path, monkeypatch):
    """``fsync: interval`` (the spool's default): rolling to a new segment and deleting
    an old one leave the syncing and unlinking to the syncer thread, so the writer (the
    gateway's loop) goes on while the disk is slow. The disk is made slow here by holding
    every ``fsync`` until the test lets go (a real disk's latency cannot be produced on
    demand); what is checked is real: which thread syncs, in what order, and that
    nothing is lost. The rolled segment is synced before anything of the new one, and a
    segment posted for deletion is gone from ``segments()`` at once."""
    import threading

    import gateway.segment_log as segment_log

    real_fsync = os.fsync
    disk = threading.Event()
    synced: list[tuple[str, str]] = []

    def slow_fsync(fd: int) -> None:
        disk.wait(30)
        synced.append((threading.current_thread().name, os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(segment_log.os, "fsync", slow_fsync)
    log = SegmentLog(tmp_path, segment_bytes=1 << 20, fsync="interval", fsync_interval_s=0.05)
    for i in range(12):
        log.append(record(i))
    first = log.current_segment
    log.roll()  # returns although every fsync is held
    for i in range(12, 20):
        log.append(record(i))
    log.delete_segment(first)
    assert first not in log.segments()  # gone for readers at once, unlinked by the syncer
    assert synced == []  # nothing synced yet: the writer did not wait for the disk
    disk.set()
    log.close()
    assert not log.path(first).exists()
    assert {name for name, _ in synced} <= {"segment-log-fsync", threading.current_thread().name}
    syncer_files = [path for name, path in synced if name == "segment-log-fsync"]
    # The rolled segment first, then the folder (the new segment's name), then the new one.
    assert syncer_files[:2] == [str(log.path(first)), str(tmp_path)]
    assert set(syncer_files[2:]) <= {str(log.path(first + 1))}
    seqs, report = read_all(tmp_path)
    assert seqs == list(range(12, 20)) and report.corrupt_records == 0


def test_a_roll_under_fsync_always_or_never_stays_on_the_writers_thread(tmp_path, monkeypatch):
    """Without a syncer thread (``always``, ``never``), a roll syncs the rolled segment
    itself before starting the next, as before."""
    import threading

    import gateway.segment_log as segment_log

    real_fsync = os.fsync
    threads: list[str] = []

    def fsync(fd: int) -> None:
        threads.append(threading.current_thread().name)
        real_fsync(fd)

    monkeypatch.setattr(segment_log.os, "fsync", fsync)
    for policy in ("always", "never"):
        threads.clear()
        log = SegmentLog(tmp_path / policy, segment_bytes=2000, fsync=policy)
        log.append(record(0))
        log.roll()
        assert threads and set(threads) == {threading.current_thread().name}, policy
        log.delete_segment(1)
        assert not log.path(1).exists()
        log.close()
