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
