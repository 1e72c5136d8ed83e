"""Shared memory for large batches between an env worker and a gateway on one host.

A worker with thousands of envs (or camera images) sends hundreds of KiB per step. Over
a socket every byte is copied into the kernel and out again; here the worker copies each
large array once into a ring of slots in a POSIX shared-memory segment and the socket
carries only a handle (slot, key, dtype, shape, offset); the gateway reads the arrays in
place. Across hosts (or when anything below fails) the normal frames are used::

    # worker                                        # gateway
    ring = ShmWriter.create(slot_bytes)
    HELLO meta["shm"] = ring.offer()       ->       view = ShmView.attach(offer)   # maps, then unlinks
                                           <-       WELCOME meta["shm"] = {"ok": True} | {"ok": False, "reason"}
    out = ring.encode(msg)  # big arrays -> handles
    OBSERVATION out                        ->       msg = view.decode(msg)         # handles -> arrays (views)

Nothing is left in ``/dev/shm`` whatever dies when:

- the gateway unlinks the name as soon as it has mapped the segment (the worker mapped
  it when it made it), so from then on the memory lives exactly as long as the two
  mappings: the kernel frees it when both processes have exited, even by SIGKILL;
- a worker that gets no WELCOME unlinks its own segment (and uses frames);
- a worker killed between making a segment and the gateway mapping it leaves a name
  carrying its pid (``loopgate-<pid>-<hex>``): :func:`sweep_stale`, run by every worker
  and gateway at start, removes names whose process is gone.

The worker writes slot ``seq % slots``; the gateway reads a slot while it handles that
observation and the next one (the step the next one completes), and the worker writes
a new observation only after the ACTION for the previous one, so ``slots >= 2`` suffices
and 4 leaves margin. Handles are checked like frames are (dtype whitelist, bounds).
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gateway.lifeline import pid_alive
from gateway.protocol import ErrorCode, Message, ProtocolError
from gateway.protocol.codec import ALLOWED_DTYPES, MAX_NDIM

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "loopgate-"
SLOTS = 4
MIN_BYTES = 128 << 10
"""Arrays smaller than this travel as frames. Measured (one env worker, one gateway, 2
CPUs, ``benchmarks/gateway_rtt.py``'s round trip, shared memory against frames): a handle
costs more than the copies it saves up to about 100 KiB (+25 us at 4 KiB, +50-70 us at
64 KiB), is even at 128 KiB and saves 5-20 % at 150 KiB and 20-25 % at 1 MiB."""
_ALIGN = 64
_DTYPES = {name: np.dtype(name) for name in ALLOWED_DTYPES}


def host_identity() -> str:
    """Which machine (and boot) this is: shared memory works only between equal ones."""
    boot = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{socket.gethostname()}/{boot}"


def available() -> bool:
    """Whether this host has POSIX shared memory where this module looks for it."""
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def sweep_stale(directory: Path = SHM_DIR) -> list[str]:
    """Unlink segments whose creating process is gone; return their names."""
    removed: list[str] = []
    if not directory.is_dir():
        return removed
    for path in directory.glob(f"{PREFIX}*"):
        pid_text = path.name[len(PREFIX) :].partition("-")[0]
        if not pid_text.isdigit() or pid_alive(int(pid_text)):
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path.name)
    if removed:
        log.warning("removed %d shared-memory segment(s) of processes that died: %s", len(removed), removed)
    return removed


def segments_of(pid: int, directory: Path = SHM_DIR) -> list[str]:
    """Names in ``directory`` made by process ``pid`` (tests and ``loopgate doctor`` look)."""
    return sorted(p.name for p in directory.glob(f"{PREFIX}{pid}-*"))


def is_local(address: str) -> bool:
    """Whether a peer at ``address`` is on this host: an ``ipc://`` or loopback ``tcp://`` address."""
    if address.startswith(("ipc://", "inproc://")):
        return True
    host = address.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def wanted(mode: str, address: str) -> bool:
    """Whether a worker offers shared memory for ``gateway.shared_memory`` = ``mode`` and a
    gateway at ``address`` (``auto``: :func:`is_local`)."""
    if mode == "off" or not available():
        return False
    return mode == "on" or is_local(address)


def batch_bytes(observation: Mapping[str, Any], num_envs: int, info_width: int) -> int:
    """Bytes of the large arrays of one observation message: ``observation`` maps keys to
    ``ArraySpec``-like objects (``shape``, ``dtype``); ``info_width`` float64 columns of step_info."""
    per_env = sum(int(math.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in observation.values())
    return int(num_envs * (per_env + 8 * info_width))


def slot_bytes_for(array_bytes: int) -> int:
    """A slot for messages whose large arrays total ``array_bytes`` (a resend carries the
    previous observation too: twice that, plus alignment)."""
    return _round_up(2 * array_bytes + 64 * _ALIGN, mmap.PAGESIZE)


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass
class _Segment:
    name: str
    path: Path
    mm: mmap.mmap
    slots: int
    slot_bytes: int


def _map(path: Path, size: int, *, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            # Reserve the pages now: a full /dev/shm refuses here (the worker sends frames)
            # instead of killing the worker with SIGBUS at its first write into the ring.
            os.posix_fallocate(fd, 0, size)
        elif os.fstat(fd).st_size < size:
            raise ValueError(f"segment {path.name} has {os.fstat(fd).st_size} bytes, the offer says {size}")
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        if create:  # nobody else knows the name yet
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        raise
    finally:
        os.close(fd)


class ShmWriter:
    """The worker's side: one segment of ``slots`` slots, made once per connection."""

    def __init__(self, seg: _Segment) -> None:
        self.seg = seg
        self.linked = True
        """The name still exists in /dev/shm (until the gateway or :meth:`unlink` removes it)."""
        self.bytes_shared = 0
        """Array bytes written into the segment so far."""
        self.bytes_framed = 0
        """Array bytes of messages that went as frames (small, or not fitting a slot)."""

    @classmethod
    def create(cls, slot_bytes: int, slots: int = SLOTS, directory: Path = SHM_DIR) -> ShmWriter:
        if slot_bytes < 1 or slots < 1:
            raise ValueError(f"slot_bytes and slots must be >= 1, got {slot_bytes} and {slots}")
        name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        path = directory / name
        mm = _map(path, slots * slot_bytes, create=True)
        return cls(_Segment(name, path, mm, slots, slot_bytes))

    @classmethod
    def for_worker(
        cls, mode: str, address: str, observation: Mapping[str, Any], num_envs: int, info_width: int
    ) -> ShmWriter | None:
        """The ring a worker offers its gateway at ``address`` (``gateway.shared_memory`` =
        ``mode``), or None: not wanted, batches too small to gain, or no room in /dev/shm."""
        if not wanted(mode, address):
            return None
        size = batch_bytes(observation, num_envs, info_width)
        if size < MIN_BYTES:
            return None  # small batches: frames cost less than the copies they would save
        sweep_stale()
        try:
            return cls.create(slot_bytes_for(size))
        except OSError as exc:
            log.warning("no shared-memory ring (%s); sending frames", exc)
            return None

    def answered(self, answer: Any) -> bool:
        """WELCOME's ``meta["shm"]``: True when the gateway mapped the ring; otherwise the
        ring is closed (its name removed) and the worker sends frames."""
        if isinstance(answer, dict) and answer.get("ok"):
            self.accepted()
            log.info("large arrays go through shared memory %s", self.seg.name)
            return True
        reason = answer.get("reason") if isinstance(answer, dict) else "the gateway does not map segments"
        log.info("gateway declined shared memory (%s); sending frames", reason)
        self.close()
        return False

    def offer(self) -> dict[str, Any]:
        """What HELLO carries in ``meta["shm"]``."""
        s = self.seg
        return {
            "name": s.name,
            "slots": s.slots,
            "slot_bytes": s.slot_bytes,
            "host": host_identity(),
            "pid": os.getpid(),
        }

    def unlink(self) -> None:
        """Remove the name (the memory stays while mapped); idempotent."""
        if self.linked:
            with contextlib.suppress(FileNotFoundError):
                self.seg.path.unlink()
            self.linked = False

    def accepted(self) -> None:
        """The gateway mapped the segment and removed its name."""
        self.linked = self.seg.path.exists()
        if self.linked:  # a gateway that mapped it but could not unlink it: do it here
            self.unlink()

    def encode(self, msg: Message) -> Message:
        """``msg`` with its large arrays written into slot ``msg.seq % slots`` and sent as
        handles (``meta["shm"]``); the rest, and what does not fit, stay frames."""
        s = self.seg
        slot = msg.seq % s.slots
        base, end = slot * s.slot_bytes, (slot + 1) * s.slot_bytes
        offset = base
        handles: list[list[Any]] = []
        frames: dict[str, np.ndarray] = {}
        for key, value in msg.arrays.items():
            arr = np.asarray(value)
            size = arr.nbytes
            if size < MIN_BYTES or offset + size > end or arr.dtype.name not in ALLOWED_DTYPES:
                frames[key] = value
                self.bytes_framed += size
                continue
            dst = np.frombuffer(s.mm, dtype=arr.dtype, count=arr.size, offset=offset).reshape(arr.shape)
            np.copyto(dst, arr)
            del dst
            handles.append([key, arr.dtype.name, list(arr.shape), offset - base])
            offset = _round_up(offset + size, _ALIGN)
            self.bytes_shared += size
        if not handles:
            return msg
        meta = {**msg.meta, "shm": {"slot": slot, "arrays": handles}}
        return Message(msg.type, seq=msg.seq, meta=meta, arrays=frames)

    def close(self) -> None:
        self.unlink()
        with contextlib.suppress(BufferError):
            self.seg.mm.close()


class ShmView:
    """The gateway's side: a worker's segment, mapped, its name removed."""

    def __init__(self, seg: _Segment) -> None:
        self.seg = seg
        self.bytes_shared = 0
        """Array bytes read in place so far."""

    @classmethod
    def attach(cls, offer: Mapping[str, Any], directory: Path = SHM_DIR) -> ShmView:
        """Map the segment a HELLO offers and unlink its name; raise ValueError saying why
        it cannot be used (the worker then sends frames). The name is unlinked even then,
        so a refused segment cannot outlive its worker."""
        name, slots, slot_bytes = offer.get("name"), offer.get("slots"), offer.get("slot_bytes")
        if not isinstance(name, str) or not name.startswith(PREFIX) or "/" in name:
            raise ValueError(f"shm offer names {name!r}, not a loopgate segment")
        if offer.get("host") != host_identity():
            raise ValueError("the worker runs on another host (or boot), so frames it is")
        path = directory / name
        try:
            for what, v in (("slots", slots), ("slot_bytes", slot_bytes)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValueError(f"shm offer: {what} must be an int >= 1, got {v!r}")
            assert isinstance(slots, int) and isinstance(slot_bytes, int)
            try:
                mm = _map(path, slots * slot_bytes, create=False)
            except FileNotFoundError:
                raise ValueError(f"shared-memory segment {name} does not exist (its worker died?)") from None
            except OSError as exc:
                raise ValueError(f"shared-memory segment {name} cannot be mapped: {exc}") from None
        finally:
            with contextlib.suppress(FileNotFoundError, PermissionError):
                path.unlink()
        return cls(_Segment(name, path, mm, slots, slot_bytes))

    @staticmethod
    def discard(offer: Mapping[str, Any], directory: Path = SHM_DIR) -> None:
        """Unlink the segment an offer names without mapping it (a gateway that declines
        still removes the name: the worker sends frames)."""
        name = offer.get("name")
        ours = isinstance(name, str) and name.startswith(PREFIX) and "/" not in name
        if ours and offer.get("host") == host_identity():
            with contextlib.suppress(FileNotFoundError, PermissionError):
                (directory / str(name)).unlink()

    def decode(self, msg: Message) -> Message:
        """``msg`` with the arrays its ``meta["shm"]`` handles name, read in place (views
        valid until the worker reuses the slot: two observations later at the earliest).
        Raises :class:`ProtocolError` naming a bad handle."""
        handle = msg.meta.get("shm")
        if handle is None:
            return msg
        s = self.seg

        def bad(text: str) -> ProtocolError:
            return ProtocolError(ErrorCode.BAD_REQUEST, f"shared-memory handle: {text}")

        if not isinstance(handle, dict) or not isinstance(handle.get("arrays"), list):
            raise bad("meta shm must be {slot, arrays}")
        slot = handle.get("slot")
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < s.slots:
            raise bad(f"slot {slot!r} is not in [0, {s.slots})")
        arrays = dict(msg.arrays)
        for entry in handle["arrays"]:
            if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str)):
                raise bad(f"entry {entry!r} must be [key, dtype, shape, offset]")
            key, dtype_name, shape, offset = entry
            dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
            if dtype is None:
                raise bad(f"array {key!r}: dtype {dtype_name!r} is not allowed")
            if (
                not isinstance(shape, list)
                or len(shape) > MAX_NDIM
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
            ):
                raise bad(f"array {key!r}: bad shape {shape!r}")
            size = math.prod(shape) * dtype.itemsize
            if (
                not isinstance(offset, int)
                or isinstance(offset, bool)
                or offset < 0
                or offset + size > s.slot_bytes
            ):
                raise bad(
                    f"array {key!r}: {size} bytes at offset {offset!r} do not fit a {s.slot_bytes}-byte slot"
                )
            if key in arrays:
                raise bad(f"array {key!r} is both a frame and a handle")
            start = slot * s.slot_bytes + offset
            view = np.frombuffer(s.mm, dtype=dtype, count=math.prod(shape), offset=start).reshape(shape)
            view.flags.writeable = False
            arrays[key] = view
            self.bytes_shared += size
        meta = {k: v for k, v in msg.meta.items() if k != "shm"}
        return Message(msg.type, seq=msg.seq, meta=meta, arrays=arrays)
