"""CUDA IPC handles on the wire: what they hold and how they are checked (no torch here).

:mod:`gateway.cuda_ipc` makes and opens them; this module only describes and checks
them, so the gateway, which passes a worker's handles on to inference servers, never
imports torch. A tensor travels as ``[key, dtype, shape, stride, offset, storage]``, its
storage as the eight values ``torch.UntypedStorage._share_cuda_`` returns (device index,
memory handle, size and offset in bytes, ref-counter name and offset, event handle,
whether the event must be waited on)::

    handle = check_handle(meta["cuda_ipc"])        # DeviceHandle, or ProtocolError bad_request
    offer = RingOffer.parse(hello_meta["cuda_ipc"])  # a worker's ring; ValueError says why not
    infer_meta["cuda_ipc"] = offer.handle(observation_meta["cuda_ipc"])
    same_device(server_declaration, infer_meta["cuda_ipc"])   # host and GPU UUID equal

A handle (the ``cuda_ipc`` meta of INFER and WEIGHTS) is
``{v, host, uuid, pid, event, arrays}``; a ring offer (HELLO) is
``{v, host, uuid, pid, slots, slot_arrays}`` and a step (OBSERVATION) ``{slot, event}``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np

from gateway.protocol import ErrorCode, ProtocolError
from gateway.protocol.codec import ALLOWED_DTYPES, DEFAULT_LIMITS, MAX_NDIM, Limits
from gateway.shm import host_identity

VERSION = 1
MAX_SLOTS = 64
EVENT_BYTES = 64
"""CUDA's IPC handle size (``CUDA_IPC_HANDLE_SIZE``)."""
MAX_HANDLE_BYTES = 4096
"""A memory handle is 64 bytes plus torch's kind byte; expandable segments send more."""
REF_PREFIX = b"/torch_"
"""torch's ref-counter files are POSIX shared memory named ``/torch_<pid>_...``."""
_ITEMSIZE = {name: np.dtype(name).itemsize for name in ALLOWED_DTYPES}


@dataclass(frozen=True)
class ArrayHandle:
    """One tensor in a shared storage: ``[key, dtype, shape, stride, offset, storage]``."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    storage: list[Any]
    """``[device, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event, event_sync]``."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEMSIZE[self.dtype]

    def entry(self) -> list[Any]:
        return [self.key, self.dtype, list(self.shape), list(self.stride), self.offset, self.storage]


def _int(value: Any, low: int = 0) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _dims(value: Any) -> bool:
    return isinstance(value, list) and len(value) <= MAX_NDIM and all(_int(d) for d in value)


def _check_storage(key: str, s: Any, max_bytes: int) -> None:
    if not (isinstance(s, list) and len(s) == 8):
        raise ValueError(
            f"array {key!r}: storage must be [device, handle, size, offset, ref, ref_offset, event, sync]"
        )
    device, handle, size, offset, ref, ref_offset, event, sync = s
    problems = []
    if not _int(device):
        problems.append(f"device {device!r} is not an index")
    if not isinstance(handle, bytes) or not 1 <= len(handle) <= MAX_HANDLE_BYTES:
        problems.append("the memory handle must be 1..4096 bytes")
    if not _int(size, 1) or size > max_bytes:
        problems.append(f"storage size {size!r} is not in 1..{max_bytes} bytes")
    if not _int(offset):
        problems.append(f"storage offset {offset!r} is not a non-negative int")
    if not (
        isinstance(ref, bytes)
        and ref.startswith(REF_PREFIX)
        and len(ref) <= 256
        and b"/" not in ref[1:]
        and b"\0" not in ref
    ):
        problems.append(f"ref counter {ref!r} is not a torch ref-counter name")
    if not _int(ref_offset):
        problems.append(f"ref counter offset {ref_offset!r} is not a non-negative int")
    if not isinstance(event, bytes) or len(event) != EVENT_BYTES or not isinstance(sync, bool):
        problems.append("event must be 64 bytes and event_sync a bool")
    if problems:
        raise ValueError(f"array {key!r}: " + "; ".join(problems))


def parse_arrays(entries: Any, max_bytes: int) -> list[ArrayHandle]:
    """Checked :class:`ArrayHandle` s from wire entries; ValueError naming the problem."""
    if not isinstance(entries, list) or not entries:
        raise ValueError("arrays must be a non-empty list of [key, dtype, shape, stride, offset, storage]")
    out: list[ArrayHandle] = []
    seen: set[str] = set()
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 6 and isinstance(entry[0], str) and entry[0]):
            raise ValueError(f"entry {str(entry)[:120]} must be [key, dtype, shape, stride, offset, storage]")
        key, dtype, shape, stride, offset, storage = entry
        if key in seen:
            raise ValueError(f"array {key!r} appears twice")
        seen.add(key)
        if not isinstance(dtype, str) or dtype not in ALLOWED_DTYPES:
            raise ValueError(f"array {key!r}: dtype {dtype!r} is not allowed")
        if not _dims(shape) or not _dims(stride) or len(stride) != len(shape):
            raise ValueError(f"array {key!r}: bad shape {shape!r} or stride {stride!r}")
        if not _int(offset):
            raise ValueError(f"array {key!r}: offset {offset!r} is not a non-negative int")
        _check_storage(key, storage, max_bytes)
        itemsize = _ITEMSIZE[dtype]
        if math.prod(shape) * itemsize > max_bytes:
            raise ValueError(
                f"array {key!r}: {math.prod(shape) * itemsize} bytes exceed the limit of {max_bytes}"
            )
        if math.prod(shape):
            extent = (offset + sum((d - 1) * s for d, s in zip(shape, stride)) + 1) * itemsize
            if extent > storage[2]:
                raise ValueError(
                    f"array {key!r}: {dtype}{shape} at offset {offset} needs {extent} bytes; its storage has {storage[2]}"
                )
        out.append(ArrayHandle(key, dtype, tuple(shape), tuple(stride), offset, storage))
    return out


@dataclass(frozen=True)
class DeviceHandle:
    """A checked handle: tensors in storages of one GPU, and the event to wait on."""

    host: str
    uuid: str
    pid: int
    event: bytes | None
    arrays: list[ArrayHandle]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def layout(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {a.key: (a.dtype, a.shape) for a in self.arrays}


def _event(value: Any) -> bytes | None:
    if value is None or (isinstance(value, bytes) and len(value) == EVENT_BYTES):
        return value
    raise ValueError(f"event must be {EVENT_BYTES} bytes or nil, got {type(value).__name__}")


def check_handle(value: Any, limits: Limits = DEFAULT_LIMITS) -> DeviceHandle:
    """``meta["cuda_ipc"]`` of an INFER or WEIGHTS message, checked (no torch needed);
    :class:`ProtocolError` ``bad_request`` naming what is wrong."""
    try:
        if not isinstance(value, dict):
            raise ValueError("must be a map {v, host, uuid, pid, event, arrays}")
        if value.get("v") != VERSION:
            raise ValueError(f"version {value.get('v')!r} is not {VERSION}")
        host, uuid, pid = value.get("host"), value.get("uuid"), value.get("pid")
        if not isinstance(host, str) or not isinstance(uuid, str) or not uuid or not _int(pid):
            raise ValueError("host and uuid must be strings, pid an int")
        arrays = parse_arrays(value.get("arrays"), limits.max_frame_bytes)
        handle = DeviceHandle(host, uuid, pid, _event(value.get("event")), arrays)
    except ValueError as exc:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"CUDA IPC handle: {exc}") from None
    if handle.nbytes > limits.max_message_bytes:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"CUDA IPC handle: {handle.nbytes} bytes exceed max_message_bytes={limits.max_message_bytes}",
        )
    return handle


def handle_dict(uuid: str, event: bytes | None, entries: list[list[Any]]) -> dict[str, Any]:
    return {
        "v": VERSION,
        "host": host_identity(),
        "uuid": uuid,
        "pid": os.getpid(),
        "event": event,
        "arrays": entries,
    }


@dataclass(frozen=True)
class RingOffer:
    """A worker's ring as the gateway keeps it (checked, never opened: no torch here)."""

    host: str
    uuid: str
    pid: int
    slots: list[list[list[Any]]]
    """Per slot, the wire entries of its arrays."""

    @classmethod
    def parse(cls, offer: Any, limits: Limits = DEFAULT_LIMITS) -> RingOffer:
        """The checked offer of a HELLO; ValueError saying why it cannot be used."""
        if not isinstance(offer, dict) or offer.get("v") != VERSION:
            raise ValueError(f"a CUDA IPC offer must be a map with v={VERSION}")
        if offer.get("host") != host_identity():
            raise ValueError("the worker runs on another host (or boot)")
        uuid, pid, slots = offer.get("uuid"), offer.get("pid"), offer.get("slot_arrays")
        if not isinstance(uuid, str) or not uuid or not _int(pid):
            raise ValueError("uuid must be a string and pid an int")
        if (
            not isinstance(slots, list)
            or not 1 <= len(slots) <= MAX_SLOTS
            or offer.get("slots") != len(slots)
        ):
            raise ValueError(f"slot_arrays must list 1..{MAX_SLOTS} slots, as many as slots says")
        layout = None
        for i, entries in enumerate(slots):
            arrays = parse_arrays(entries, limits.max_frame_bytes)
            this = [(a.key, a.dtype, a.shape) for a in arrays]
            if layout is not None and this != layout:
                raise ValueError(f"slot {i} holds {this}, slot 0 {layout}")
            layout = this
        return cls(offer["host"], uuid, pid, slots)

    def handle(self, step: Any) -> dict[str, Any]:
        """The self-contained handle an INFER carries for an observation's ``meta["cuda_ipc"]``."""
        slot = step.get("slot") if isinstance(step, dict) else None
        if not _int(slot) or slot >= len(self.slots):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"CUDA IPC step: slot {slot!r} is not in [0, {len(self.slots)})"
            )
        try:
            event = _event(step.get("event"))
        except ValueError as exc:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"CUDA IPC step: {exc}") from None
        return {
            "v": VERSION,
            "host": self.host,
            "uuid": self.uuid,
            "pid": self.pid,
            "event": event,
            "arrays": self.slots[slot],
        }


def same_device(declared: Any, handle: Mapping[str, Any]) -> bool:
    """Whether a server's declaration (``{host, uuid}``) names the GPU of ``handle``."""
    return (
        isinstance(declared, dict)
        and declared.get("host") == handle.get("host")
        and declared.get("uuid") == handle.get("uuid")
    )
