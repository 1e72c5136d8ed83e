"""An append-only log of protocol messages in checksummed segment files.

Used by the gateway's spool, the local episode store and the replay service's durable
log. Each record is one :class:`~gateway.protocol.Message`, stored as its wire frames::

    b"LGRC" | u32 payload length | u32 crc32(payload) | payload
    payload = u32 frame count | u64 length per frame | frame bytes ...

Writes go straight to the file with ``os.writev`` (no copies of array data), so a
record that :meth:`SegmentLog.append` returned from survives the writing process being
killed; :meth:`SegmentLog.commit` adds ``fsync`` per the configured policy for power
loss (group commit: append many, commit once). On open, a torn tail (a record cut off
by a crash) is detected and cut; while reading, a corrupted record (bad checksum) is
reported and skipped, and reading resumes at the next valid record::

    log = SegmentLog("runs/x/spool", fsync="interval")
    log.append(msg); log.commit()
    for position, msg in log.read():
        ...
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import queue
import re
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from gateway.protocol import ErrorCode, Limits, Message, ProtocolError, decode, encode

log = logging.getLogger(__name__)

MAGIC = b"LGRC"
_HEAD = struct.Struct("<4sII")
_COUNT = struct.Struct("<I")
_SEGMENT_RE = re.compile(r"^seg-(\d{12})\.log$")
_LOG_LIMITS = Limits(
    max_frames=1 << 16, max_header_bytes=64 << 20, max_frame_bytes=1 << 34, max_message_bytes=1 << 36
)
FsyncPolicy = Literal["never", "interval", "always"]


@dataclass
class ReadReport:
    """What reading a log found besides good records."""

    records: int = 0
    corrupt_records: int = 0
    corrupt_segments: list[int] = field(default_factory=list)
    skipped_bytes: int = 0


@dataclass(frozen=True, order=True)
class Position:
    """Where a record starts: segment number and byte offset."""

    segment: int
    offset: int


def _frames_payload(msg: Message) -> list[bytes | memoryview]:
    frames = encode(msg)
    views = [memoryview(f).cast("B") if not isinstance(f, bytes) else f for f in frames]
    lengths = struct.pack(
        f"<I{len(views)}Q", len(views), *(v.nbytes if isinstance(v, memoryview) else len(v) for v in views)
    )
    return [lengths, *views]


def _sync_and_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Syncer(threading.Thread):
    """``fsync: interval`` off the writer's thread: an fsync can take tens of milliseconds
    (a whole 64 MB segment's, at a roll: 25-30 ms here), and the writer (the gateway's
    loop) must not stall on it. The writer never waits for this thread: it posts jobs,
    done in order, at once: a rolled segment's descriptor to sync and close (its records
    are on disk before anything of the next segment is synced), the folder to sync (the
    new segment's name), whole segments to delete (retention; unlinking 64 MB takes 13 ms
    here). Between jobs, every interval, it syncs its own duplicate of the current
    segment's descriptor if records were appended."""

    def __init__(self, interval_s: float) -> None:
        super().__init__(name="segment-log-fsync", daemon=True)
        self.interval_s = interval_s
        self.fd: int | None = None
        self.dirty = False
        self.deleting: set[Path] = set()
        """Segments posted for deletion and not yet gone (the log lists them as gone)."""
        self._jobs: queue.SimpleQueue[tuple[str, int | Path | None]] = queue.SimpleQueue()

    def set_fd(self, fd: int) -> None:
        """Sync a duplicate of ``fd`` (the current segment's) from now on."""
        self._jobs.put(("fd", os.dup(fd)))

    def retire(self, fd: int) -> None:
        """Sync and close ``fd``, a rolled segment's descriptor (this thread owns it now)."""
        self._jobs.put(("retire", fd))

    def sync_dir(self, directory: Path) -> None:
        self._jobs.put(("dir", directory))

    def delete(self, path: Path) -> None:
        self.deleting.add(path)
        self._jobs.put(("delete", path))

    def run(self) -> None:
        next_sync = time.monotonic() + self.interval_s
        while True:
            try:
                kind, arg = self._jobs.get(timeout=max(0.0, next_sync - time.monotonic()))
            except queue.Empty:
                kind, arg = "sync", None
                next_sync = time.monotonic() + self.interval_s
            try:
                self._do(kind, arg)
            except OSError as exc:  # a failing disk: the writer's own fsync at close reports it too
                log.error("segment log: %s %s failed: %s", kind, arg or "", exc)
            if kind == "stop":
                return

    def _do(self, kind: str, arg: int | Path | None) -> None:
        if kind in ("sync", "stop"):
            if self.dirty and self.fd is not None:
                self.dirty = False
                os.fsync(self.fd)
            if kind == "stop" and self.fd is not None:
                os.close(self.fd)
                self.fd = None
        elif kind == "fd":
            assert isinstance(arg, int)
            if self.fd is not None:
                os.close(self.fd)  # the rolled segment: its writer's descriptor is synced
            self.fd = arg
        elif kind == "retire":
            assert isinstance(arg, int)
            _sync_and_close(arg)
        elif kind == "dir":
            assert isinstance(arg, Path)
            _sync_and_close(os.open(arg, os.O_RDONLY))
        elif kind == "delete":
            assert isinstance(arg, Path)
            try:
                arg.unlink(missing_ok=True)
            finally:
                self.deleting.discard(arg)

    def stop(self) -> None:
        """Finish every job posted (syncs, deletions), then end."""
        self._jobs.put(("stop", None))
        self.join(timeout=60)


class SegmentLog:
    """Append-only, checksummed, segmented record log in one folder."""

    def __init__(
        self,
        directory: str | Path,
        *,
        segment_bytes: int = 64 << 20,
        fsync: FsyncPolicy = "interval",
        fsync_interval_s: float = 1.0,
        readonly: bool = False,
    ) -> None:
        self.directory = Path(directory)
        self.segment_bytes = segment_bytes
        self.fsync = fsync
        self.fsync_interval_s = fsync_interval_s
        self.readonly = readonly
        self._fd: int | None = None
        self._segment = 0
        self._size = 0
        self._dirty = False
        self._last_sync = time.monotonic()
        self.torn_bytes_cut = 0
        self.bytes_written = 0
        """Record bytes this process appended (headers included): what the data path copied into the file."""
        self._syncer: _Syncer | None = None
        if not readonly:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._open_tail()
            if fsync == "interval":
                self._syncer = _Syncer(fsync_interval_s)
                assert self._fd is not None
                self._syncer.set_fd(self._fd)
                self._syncer.start()

    # ------------------------------------------------------------------ segments

    def segments(self) -> list[int]:
        """Segment numbers present, oldest first."""
        if not self.directory.exists():
            return []
        found = []
        deleting = self._syncer.deleting if self._syncer is not None else ()
        for entry in os.listdir(self.directory):
            m = _SEGMENT_RE.match(entry)
            if m and (not deleting or self.directory / entry not in deleting):
                found.append(int(m.group(1)))
        return sorted(found)

    def path(self, segment: int) -> Path:
        return self.directory / f"seg-{segment:012d}.log"

    @property
    def current_segment(self) -> int:
        return self._segment

    @property
    def current_size(self) -> int:
        """Bytes in the segment being written."""
        return self._size

    def _open_tail(self) -> None:
        segs = self.segments()
        if segs:
            self._segment = segs[-1]
            good_end = self._valid_prefix(self._segment)
            size = self.path(self._segment).stat().st_size
            if good_end < size:
                # A crash mid-write leaves a partial record at the end: cut it so new
                # records are not appended behind garbage.
                log.warning(
                    "segment %d: cutting %d bytes of torn tail at offset %d",
                    self._segment,
                    size - good_end,
                    good_end,
                )
                os.truncate(self.path(self._segment), good_end)
                self.torn_bytes_cut += size - good_end
            self._size = good_end
        else:
            self._segment = 1
            self._size = 0
        self._fd = os.open(self.path(self._segment), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _valid_prefix(self, segment: int) -> int:
        """Offset after the last record that parses and checks out (scanning from 0)."""
        end = 0
        with open(self.path(segment), "rb") as f:
            data = f.read()
        offset = 0
        while offset + _HEAD.size <= len(data):
            magic, length, crc = _HEAD.unpack_from(data, offset)
            start = offset + _HEAD.size
            if magic != MAGIC or start + length > len(data):
                break
            if zlib.crc32(memoryview(data)[start : start + length]) != crc:
                # Only a bad record at the very end is a torn tail; one in the middle
                # is corruption that reading reports and skips.
                nxt = data.find(MAGIC, start)
                if nxt < 0:
                    break
                offset = nxt
                continue
            offset = start + length
            end = offset
        return end

    def roll(self) -> int:
        """Start a new segment; return its number. Under ``fsync: interval`` the rolled
        segment is synced and closed by the syncer thread, ahead of anything later."""
        self._check_writable()
        assert self._fd is not None
        if self._syncer is None:
            self.commit(force=True)
            os.close(self._fd)
        else:
            self._syncer.retire(self._fd)
            self._dirty = False
        self._segment += 1
        self._size = 0
        self._fd = os.open(self.path(self._segment), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if self._syncer is not None:
            self._syncer.set_fd(self._fd)
            self._syncer.sync_dir(self.directory)
        else:
            self._fsync_dir()
        return self._segment

    def delete_segment(self, segment: int) -> None:
        """Remove a whole segment (retention); the segment being written is never removed.
        Under ``fsync: interval`` the syncer thread unlinks it; it is gone from
        :meth:`segments` at once."""
        if segment == self._segment and not self.readonly:
            raise ValueError("cannot delete the segment being written")
        if self._syncer is not None:
            self._syncer.delete(self.path(segment))
        else:
            self.path(segment).unlink(missing_ok=True)

    def size_bytes(self) -> int:
        return sum(self.path(s).stat().st_size for s in self.segments() if self.path(s).exists())

    # --------------------------------------------------------------------- write

    def _check_writable(self) -> None:
        if self.readonly or self._fd is None:
            raise ValueError("log is read-only or closed")

    def append(self, msg: Message) -> Position:
        """Write one record; it survives this process being killed once this returns.

        Raises ``OSError`` (e.g. ``ENOSPC``) if the disk refuses it; a partially
        written record is cut on the next open.
        """
        self._check_writable()
        parts = _frames_payload(msg)
        length = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
        crc = 0
        for part in parts:
            crc = zlib.crc32(part, crc)
        if self._size > 0 and self._size + _HEAD.size + length > self.segment_bytes:
            self.roll()
        assert self._fd is not None
        pos = Position(self._segment, self._size)
        buffers = [_HEAD.pack(MAGIC, length, crc), *parts]
        total = _HEAD.size + length
        try:
            written = os.writev(self._fd, buffers)
            if written != total:
                # writev may stop short (signals, large writes): finish the rest.
                remaining = b"".join(bytes(b) for b in buffers)[written:]
                while remaining:
                    n = os.write(self._fd, remaining)
                    remaining = remaining[n:]
        except OSError:
            # A refused write (disk full) can leave part of the record behind: cut it, so
            # the segment stays a clean run of records and appends after the disk frees up
            # are readable without being taken for corruption.
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)
            raise
        self._size += total
        self.bytes_written += total
        self._dirty = True
        if self._syncer is not None:
            self._syncer.dirty = True
        return pos

    def commit(self, *, force: bool = False) -> bool:
        """Apply the fsync policy to what was appended; return whether it synced."""
        if self._fd is None or not self._dirty:
            return False
        if self._syncer is not None and not force:
            return False  # the syncer thread fsyncs every interval
        now = time.monotonic()
        due = (
            force
            or self.fsync == "always"
            or (self.fsync == "interval" and now - self._last_sync >= self.fsync_interval_s)
        )
        if not due:
            return False
        os.fsync(self._fd)
        self._dirty = False
        self._last_sync = now
        return True

    def _fsync_dir(self) -> None:
        if self.fsync == "never":
            return
        _sync_and_close(os.open(self.directory, os.O_RDONLY))

    def close(self) -> None:
        if self._syncer is not None:
            self._syncer.stop()
            self._syncer = None
        if self._fd is not None:
            if self.fsync != "never":
                self.commit(force=True)
            os.close(self._fd)
            self._fd = None

    # ---------------------------------------------------------------------- read

    def read(
        self, *, start: Position | None = None, report: ReadReport | None = None
    ) -> Iterator[tuple[Position, Message]]:
        """Yield ``(position, message)`` for every valid record, oldest first.

        Corrupted records are logged, counted in ``report`` and skipped; records after
        them in the same segment are found again by their magic and checksum.
        """
        report = report if report is not None else ReadReport()
        segments = self.segments()
        for segment in segments:
            if start is not None and segment < start.segment:
                continue
            first = start.offset if start is not None and segment == start.segment else 0
            yield from self._read_segment(segment, first, report, is_last=segment == segments[-1])

    def _read_segment(
        self, segment: int, first: int, report: ReadReport, *, is_last: bool
    ) -> Iterator[tuple[Position, Message]]:
        path = self.path(segment)
        if not path.exists():  # removed by retention while we were reading
            return
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                offset = first
                corrupt_here = False
                while offset + _HEAD.size <= size:
                    magic, length, crc = _HEAD.unpack_from(mm, offset)
                    start = offset + _HEAD.size
                    ok = magic == MAGIC and start + length <= size
                    payload = bytes(mm[start : start + length]) if ok else b""
                    if ok and zlib.crc32(payload) == crc:
                        try:
                            msg = _decode_payload(payload)
                        except ProtocolError as exc:
                            log.error(
                                "segment %d offset %d: record does not decode: %s", segment, offset, exc
                            )
                            ok = False
                        else:
                            report.records += 1
                            yield Position(segment, offset), msg
                            offset = start + length
                            continue
                    if not (ok and start + length <= size) and mm.find(MAGIC, offset + 1) < 0:
                        # An unfinished record at the end of the newest segment is a
                        # write in progress or a torn tail, not corruption.
                        if offset < size and not is_last:
                            self._note_corrupt(report, segment, offset, size - offset, corrupt_here)
                        break
                    nxt = mm.find(MAGIC, offset + 1)
                    if nxt < 0:
                        nxt = size
                    self._note_corrupt(report, segment, offset, nxt - offset, corrupt_here)
                    corrupt_here = True
                    offset = nxt

    @staticmethod
    def _note_corrupt(report: ReadReport, segment: int, offset: int, nbytes: int, seen: bool) -> None:
        report.corrupt_records += 1
        report.skipped_bytes += nbytes
        if not seen:
            report.corrupt_segments.append(segment)
            log.error("segment %d: corrupted record at offset %d (%d bytes skipped)", segment, offset, nbytes)


def _decode_payload(payload: bytes) -> Message:
    view = memoryview(payload)
    short = ProtocolError(ErrorCode.TRUNCATED, "record payload does not match its frame table")
    if len(view) < _COUNT.size:
        raise short
    (count,) = _COUNT.unpack_from(view, 0)
    lens_end = _COUNT.size + 8 * count
    if count == 0 or lens_end > len(view):
        raise short
    lengths = struct.unpack_from(f"<{count}Q", view, _COUNT.size)
    frames = []
    offset = lens_end
    for n in lengths:
        frames.append(view[offset : offset + n])
        offset += n
    if offset != len(view):
        raise short
    return decode(frames, _LOG_LIMITS)
