"""Versioned weights on the wire: bucketed tensors or an ONNX blob, and their publisher.

A trainer publishes a new policy version to every inference server at once::

    publisher = WeightsPublisher([e["weights"] for e in endpoints["inference"]])
    publisher.publish(state_dict_numpy(actor), version=7)   # -> one result per server
    publisher.publish_onnx(export_onnx(actor), version=8)
    publisher.rollback()                                     # every server back one version
    publisher.close()

**Wire format.** One publication is a *transfer* of ``n`` WEIGHTS messages (buckets),
each at most ``bucket_bytes`` of array data, sent back to back without waiting
(pipelined) from the arrays' own memory (``copy=False``). Each bucket's meta::

    {"version": 7, "format": "state_dict" | "onnx", "transfer": "<id>",
     "bucket": i, "buckets": n, "tensors": <count in the transfer>,
     "bytes": <array bytes in the transfer>, "parts": {name: [offset, [full shape]]}}

Arrays travel under their state-dict names (the codec's header carries dtype and
shape). A tensor larger than a bucket travels as flat slices, one per bucket, listed in
``parts`` with the element offset of the slice and the tensor's full shape; an ONNX
model travels as the uint8 array ``onnx``, sliced the same way. Buckets of a transfer
arrive in order on one connection; the last one commits: the server validates the
whole set (names, shapes, dtypes, finite values; for ONNX: it parses, its inputs and
outputs fit the spec, it runs), loads it into a second buffer and swaps it in between
two batches, then answers WEIGHTS_ACK ``{version, previous}``. Anything wrong is
answered with ERROR ``bad_weights`` (including a transfer with a missing bucket) or
``stale_version`` (not newer than the version serving), and the old version keeps
serving. ``COMMAND {"cmd": "rollback"}`` on the same socket swaps the previous version
back in.

**On one GPU** (``format: cuda_ipc``). A state dict of CUDA tensors goes to a server that
declares the same GPU (``cuda_ipc`` in its METADATA reply, asked once per server) as one
WEIGHTS message without arrays: ``meta["cuda_ipc"]`` is a handle of the tensors copied into
the publisher's staging buffers (:class:`gateway.cuda_ipc.Staging`, each shared once). The
server copies them device-to-device into its own tensors, then validates, swaps and
answers as above; the publisher overwrites its staging buffers only after every answer.
Other servers get the same version as host buckets, in the same publication.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from gateway.cuda_ipc import DeviceHandle, check_handle, dtype_name
from gateway.protocol import (
    ErrorCode,
    Limits,
    Message,
    MsgType,
    ProtocolError,
    RemoteError,
    Timeout,
    recv,
    send,
)
from gateway.transport import CurveKeys, connect, make_socket
from inference.device_weights import Declaration, DeviceRoute, common_device

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 32 << 20
"""Array bytes per WEIGHTS message: large enough to amortise, small enough to pipeline."""
MAX_TENSORS_PER_BUCKET = 1000
"""Stays below the codec's default frame limit (1024 frames per message)."""
ONNX_KEY = "onnx"
FORMATS = ("state_dict", "onnx", "cuda_ipc")
DEVICE_LIMITS = Limits(max_frame_bytes=1 << 36, max_message_bytes=1 << 38)
"""Bounds of a CUDA IPC publication (its tensors are not frames: a weight matrix may be large)."""
ANSWER_CHECK_S = 0.2
"""How often a wait for a server's answer reads ``WeightsPublisher.timeout_s`` again."""
METADATA_TIMEOUT_S = 5.0
"""How long a publisher waits for a server to say which GPU it takes handles for."""


class WeightsError(ProtocolError):
    """Weights refused: ``bad_weights`` or ``stale_version``."""


@dataclass
class WeightsUpdate:
    """A complete, committed transfer, ready for validation."""

    version: int
    format: str
    arrays: dict[str, np.ndarray]
    """State-dict tensors by name, or ``{"onnx": uint8 blob}``."""
    nbytes: int
    route: bytes = b""
    seq: int = 0
    finite_checked: bool = False
    """Every float tensor was checked for NaN/Inf as its buckets arrived (overlapping the
    transfer), so loading need not read the whole state dict once more."""
    device: DeviceHandle | None = None
    """``format: cuda_ipc``: the handle of the publisher's device tensors (``arrays`` is empty)."""


def bucketize(
    arrays: Mapping[str, np.ndarray], bucket_bytes: int
) -> list[tuple[dict[str, np.ndarray], dict[str, list[Any]]]]:
    """Split arrays into buckets of at most ``bucket_bytes``: ``[(arrays, parts), ...]`` (no copies)."""
    buckets: list[tuple[dict[str, np.ndarray], dict[str, list[Any]]]] = []
    current: dict[str, np.ndarray] = {}
    parts: dict[str, list[Any]] = {}
    size = 0

    def flush() -> None:
        nonlocal current, parts, size
        if current:
            buckets.append((current, parts))
        current, parts, size = {}, {}, 0

    for name, value in arrays.items():
        arr = np.ascontiguousarray(value)
        if arr.nbytes > bucket_bytes and arr.size > 1:
            flush()
            flat = arr.reshape(-1)
            step = max(1, bucket_bytes // arr.itemsize)
            for start in range(0, flat.size, step):
                buckets.append(({name: flat[start : start + step]}, {name: [start, list(arr.shape)]}))
            continue
        if current and (size + arr.nbytes > bucket_bytes or len(current) >= MAX_TENSORS_PER_BUCKET):
            flush()
        current[name] = arr
        size += arr.nbytes
    flush()
    return buckets or [({}, {})]


def transfer_messages(
    arrays: Mapping[str, np.ndarray], version: int, fmt: str, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> list[Message]:
    """The WEIGHTS messages of one transfer (array memory is shared, not copied)."""
    buckets = bucketize(arrays, bucket_bytes)
    transfer = uuid.uuid4().hex[:12]
    total = sum(np.asarray(a).nbytes for a in arrays.values())
    return [
        Message(
            MsgType.WEIGHTS,
            seq=i + 1,
            meta={
                "version": version,
                "format": fmt,
                "transfer": transfer,
                "bucket": i,
                "buckets": len(buckets),
                "tensors": len(arrays),
                "bytes": total,
                "parts": parts,
            },
            arrays=bucket,
        )
        for i, (bucket, parts) in enumerate(buckets)
    ]


class BufferPool:
    """Buffers that sliced tensors are reassembled into, kept from retired versions.

    A fresh 200 MB allocation costs page faults worth several copies into it, every
    publication; the server hands a version's buffers back here when it retires (two
    swaps later, or rolled back), and the next transfer of the same shape reuses them.
    Only arrays owning writable memory are kept: never views of received frames.
    """

    def __init__(self, per_shape: int = 2) -> None:
        self.per_shape = per_shape
        self._free: dict[tuple[str, tuple[int, ...]], list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        with self._lock:
            free = self._free.get((dtype.str, shape))
            if free:
                return free.pop()
        return np.empty(shape, dtype=dtype)

    def give(self, arrays: Any) -> None:
        with self._lock:
            for arr in arrays:
                if isinstance(arr, np.ndarray) and arr.flags.owndata and arr.flags.writeable:
                    free = self._free.setdefault((arr.dtype.str, arr.shape), [])
                    if len(free) < self.per_shape and not any(a is arr for a in free):
                        free.append(arr)


@dataclass
class _Transfer:
    meta: dict[str, Any]
    next_bucket: int = 0
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    filled: dict[str, int] = field(default_factory=dict)
    nbytes: int = 0


class WeightsAssembler:
    """Server side: collects the buckets of each peer's transfer until the last one commits.

    ``add`` returns the committed :class:`WeightsUpdate`, ``None`` while buckets are
    still due, and raises :class:`WeightsError` for a transfer it drops (its remaining
    buckets are then ignored).
    """

    def __init__(self, pool: BufferPool | None = None) -> None:
        self._open: dict[bytes, _Transfer] = {}
        self._dropped: dict[bytes, str] = {}
        self.pool = pool or BufferPool()

    def add(self, route: bytes, msg: Message, current_version: int) -> WeightsUpdate | None:
        meta = msg.meta
        try:
            version, fmt, transfer = int(meta["version"]), str(meta["format"]), str(meta["transfer"])
            bucket, buckets = int(meta["bucket"]), int(meta["buckets"])
            parts = dict(meta.get("parts") or {})
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightsError(ErrorCode.BAD_WEIGHTS, f"WEIGHTS meta is incomplete: {exc!r}") from None
        if fmt not in FORMATS:
            raise WeightsError(ErrorCode.BAD_WEIGHTS, f"unknown weights format {fmt!r}; known: {FORMATS}")
        if self._dropped.get(route) == transfer:
            return None  # the rest of a transfer already refused
        if fmt == "cuda_ipc":
            return self._device(route, msg, version, current_version, (bucket, buckets))
        state = self._open.get(route)
        if bucket == 0:
            if state is not None:
                log.warning("peer %s started a new transfer before finishing the last", route.hex()[:8])
            if version <= current_version:
                self._drop(route, transfer)
                raise WeightsError(
                    ErrorCode.STALE_VERSION,
                    f"version {version} is not newer than version {current_version} (serving or loading)",
                )
            state = self._open[route] = _Transfer(meta=dict(meta))
        if state is None or state.meta["transfer"] != transfer or bucket != state.next_bucket:
            expected = state.next_bucket if state is not None else 0
            self._drop(route, transfer)
            raise WeightsError(
                ErrorCode.BAD_WEIGHTS,
                f"transfer {transfer}: got bucket {bucket} of {buckets}, expected {expected}; "
                "a bucket is missing (truncated transfer)",
            )
        try:
            self._take(state, msg, parts)
        except WeightsError:
            self._drop(route, transfer)
            raise
        state.next_bucket += 1
        if state.next_bucket < buckets:
            return None
        del self._open[route]
        return self._commit(state, route, msg.seq, version, fmt)

    def _device(
        self, route: bytes, msg: Message, version: int, current_version: int, bucket: tuple[int, int]
    ) -> WeightsUpdate:
        """A ``cuda_ipc`` publication: one message of handles, checked here (never opened)."""
        meta = msg.meta
        self._open.pop(route, None)
        if bucket != (0, 1) or msg.arrays:
            raise WeightsError(
                ErrorCode.BAD_WEIGHTS,
                "a cuda_ipc publication is one WEIGHTS message of handles, without arrays",
            )
        if version <= current_version:
            raise WeightsError(
                ErrorCode.STALE_VERSION,
                f"version {version} is not newer than version {current_version} (serving or loading)",
            )
        try:
            handle = check_handle(meta.get("cuda_ipc"), DEVICE_LIMITS)
        except ProtocolError as exc:
            raise WeightsError(ErrorCode.BAD_WEIGHTS, exc.message) from None
        if len(handle.arrays) != meta.get("tensors") or handle.nbytes != meta.get("bytes"):
            raise WeightsError(
                ErrorCode.BAD_WEIGHTS,
                f"the handle holds {len(handle.arrays)} tensors / {handle.nbytes} bytes, "
                f"the meta announces {meta.get('tensors')} / {meta.get('bytes')}",
            )
        return WeightsUpdate(version, "cuda_ipc", {}, handle.nbytes, route, msg.seq, device=handle)

    def _drop(self, route: bytes, transfer: str) -> None:
        self._open.pop(route, None)
        self._dropped[route] = transfer

    def _take(self, state: _Transfer, msg: Message, parts: dict[str, Any]) -> None:
        for name, arr in msg.arrays.items():
            state.nbytes += arr.nbytes
            # Checked here, bucket by bucket, while the next buckets are still arriving.
            if arr.dtype.kind == "f" and not np.isfinite(arr).all():
                raise WeightsError(ErrorCode.BAD_WEIGHTS, f"tensor {name!r} has NaN or Inf values")
            part = parts.get(name)
            if part is None:
                if name in state.arrays:
                    raise WeightsError(ErrorCode.BAD_WEIGHTS, f"tensor {name!r} sent twice")
                state.arrays[name] = arr
                continue
            try:
                offset, shape = int(part[0]), tuple(int(d) for d in part[1])
            except (TypeError, ValueError, IndexError):
                raise WeightsError(ErrorCode.BAD_WEIGHTS, f"bad part entry for {name!r}: {part!r}") from None
            whole = state.arrays.get(name)
            if whole is None:
                if math.prod(shape) > (1 << 34) or any(d < 0 for d in shape):
                    raise WeightsError(ErrorCode.BAD_WEIGHTS, f"tensor {name!r}: bad shape {list(shape)}")
                whole = state.arrays[name] = self.pool.take(shape, arr.dtype)
                state.filled[name] = 0
            flat = whole.reshape(-1)
            if whole.dtype != arr.dtype or arr.ndim != 1 or offset != state.filled[name]:
                raise WeightsError(ErrorCode.BAD_WEIGHTS, f"tensor {name!r}: slice at {offset} does not fit")
            if offset + arr.size > flat.size:
                raise WeightsError(ErrorCode.BAD_WEIGHTS, f"tensor {name!r}: slice runs past its end")
            flat[offset : offset + arr.size] = arr
            state.filled[name] += arr.size

    def _commit(self, state: _Transfer, route: bytes, seq: int, version: int, fmt: str) -> WeightsUpdate:
        meta = state.meta
        for name, filled in state.filled.items():
            if filled != state.arrays[name].size:
                raise WeightsError(
                    ErrorCode.BAD_WEIGHTS,
                    f"tensor {name!r} is truncated: {filled} of {state.arrays[name].size} elements arrived",
                )
        if len(state.arrays) != int(meta.get("tensors", len(state.arrays))) or state.nbytes != int(
            meta.get("bytes", state.nbytes)
        ):
            raise WeightsError(
                ErrorCode.BAD_WEIGHTS,
                f"transfer is truncated: {len(state.arrays)} tensors / {state.nbytes} bytes arrived, "
                f"{meta.get('tensors')} / {meta.get('bytes')} announced",
            )
        return WeightsUpdate(
            version, fmt, state.arrays, state.nbytes, route, seq, finite_checked=fmt == "state_dict"
        )


def host_arrays(arrays: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """``arrays`` as numpy arrays: torch tensors (on any device) are copied to the host."""
    return {
        k: v if isinstance(v, np.ndarray) else np.asarray(v.detach().cpu().numpy()) for k, v in arrays.items()
    }


def _finite(arr: Any) -> bool:
    if isinstance(arr, np.ndarray):
        return arr.dtype.kind != "f" or bool(np.isfinite(arr).all())
    return not arr.is_floating_point() or bool(arr.isfinite().all())  # a torch tensor, on its device


def check_state_dict(
    arrays: Mapping[str, Any],
    expected: Mapping[str, tuple[str, tuple[int, ...]]],
    *,
    check_finite: bool = True,
) -> None:
    """Raise ``bad_weights`` unless ``arrays`` (numpy arrays or torch tensors) has exactly
    the expected names, dtypes and shapes, all finite."""
    missing = sorted(set(expected) - set(arrays))
    unexpected = sorted(set(arrays) - set(expected))
    if missing or unexpected:
        raise WeightsError(
            ErrorCode.BAD_WEIGHTS,
            f"state dict does not fit the network: missing {missing[:5]}, unexpected {unexpected[:5]}",
        )
    for name, (dtype, shape) in expected.items():
        arr = arrays[name]
        have = arr.dtype.name if isinstance(arr, np.ndarray) else dtype_name(arr)
        if have != dtype or tuple(arr.shape) != tuple(shape):
            raise WeightsError(
                ErrorCode.BAD_WEIGHTS,
                f"tensor {name!r} is {have}{list(arr.shape)}, the network needs {dtype}{list(shape)}",
            )
        if check_finite and not _finite(arr):
            raise WeightsError(ErrorCode.BAD_WEIGHTS, f"tensor {name!r} has NaN or Inf values")


# ---------------------------------------------------------------------- publisher


def weights_addresses(targets: Sequence[str | Mapping[str, Any]]) -> list[str]:
    """Addresses from plain strings or ``endpoints.json`` inference entries."""
    return [t if isinstance(t, str) else str(t["weights"]) for t in targets]


class WeightsPublisher:
    """Sends versioned weights to inference servers and waits for every answer (one result
    per server, autoscaling slots with no server left out). A state dict of CUDA tensors
    goes as a CUDA IPC handle to servers on the same GPU, as host buckets to the rest."""

    def __init__(
        self,
        targets: Sequence[str | Mapping[str, Any]],
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        keys: CurveKeys | None = None,
        timeout_s: float = 60.0,
        context: zmq.Context[Any] | None = None,
        cuda_ipc: bool = True,
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.addresses = weights_addresses(targets)
        self.optional = [isinstance(t, Mapping) and bool(t.get("autoscaled")) for t in targets]
        """Autoscaling slots: a server runs there only while load needs it. A publication
        skips one that is not connected (it catches up at the next one) instead of waiting
        for it; a planned server that is restarting gets its publication queued, as ever."""
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.cuda_ipc = cuda_ipc
        """Send CUDA tensors as handles to servers on the same GPU (else always host buckets)."""
        self._ctx = context or zmq.Context.instance()
        self.keys = keys
        self._socks: list[zmq.Socket[Any]] = []
        for address, optional in zip(self.addresses, self.optional):
            sock = make_socket(self._ctx, zmq.DEALER, sndhwm=0, rcvhwm=0)
            if optional:
                sock.immediate = True  # a send with no server connected fails at once
            connect(sock, address, keys)
            self._socks.append(sock)
        self._seq = 1 << 20
        self.gpu = DeviceRoute()
        """Which servers share this process's GPU (asked once each), and the staging buffers."""
        self.formats: list[str] = []
        """The format each server got in the last publication (``state_dict``, ``cuda_ipc``, ...)."""

    def follow(self, targets: Sequence[str | Mapping[str, Any]]) -> list[str]:
        """Re-point every server whose ``weights`` address in ``targets`` (``endpoints.json``'s
        ``inference`` list) changed: it restarted on another node. The moves, in words."""
        moved = []
        for i, new in enumerate(weights_addresses(targets)[: len(self._socks)]):
            old = self.addresses[i]
            if new == old:
                continue
            with contextlib.suppress(zmq.ZMQError):  # not connected there any more
                self._socks[i].disconnect(old)
            connect(self._socks[i], new, self.keys)
            self.addresses[i] = new
            self.gpu.forget(i)  # another node: another GPU
            moved.append(f"weights of inference server {i}: {old} -> {new}")
            log.warning("inference server %d moved: publishing its weights to %s (was %s)", i, new, old)
        return moved

    def publish(
        self, state_dict: Mapping[str, Any], version: int, *, check: bool = True
    ) -> list[dict[str, Any]]:
        """Send a state dict (numpy arrays, or torch tensors) as ``version``; one result per server."""
        device = common_device(state_dict) if self.cuda_ipc else None
        host: list[Message] | None = None
        handle: list[Message] | None = None
        plans = []
        for i in range(len(self._socks)):
            if device is not None and self.gpu.same_gpu(
                i, device, ask=functools.partial(self._ask_declaration, i)
            ):
                handle = handle or [self.gpu.message(state_dict, version)]
                plans.append(handle)
            else:
                host = host or transfer_messages(
                    host_arrays(state_dict), version, "state_dict", self.bucket_bytes
                )
                plans.append(host)
        return self._send(plans, check)

    def publish_onnx(
        self, blob: bytes | np.ndarray, version: int, *, check: bool = True
    ) -> list[dict[str, Any]]:
        """Send a serialised ONNX model as ``version``; one result per server."""
        arr = (
            np.frombuffer(blob, dtype=np.uint8) if isinstance(blob, (bytes, bytearray, memoryview)) else blob
        )
        messages = transfer_messages({ONNX_KEY: arr}, version, "onnx", self.bucket_bytes)
        return self._send([messages] * len(self._socks), check)

    def rollback(self, *, check: bool = True) -> list[dict[str, Any]]:
        """Every server swaps its previous version back in."""
        self._seq += 1
        command = [Message(MsgType.COMMAND, seq=self._seq, meta={"cmd": "rollback"})]
        return self._send([command] * len(self._socks), check)

    def _ask_declaration(self, i: int) -> Declaration:
        """Server ``i``'s ``cuda_ipc`` declaration from METADATA (:data:`Declaration`)."""
        sock = self._socks[i]
        self._seq += 1
        seq = self._seq
        try:
            send(sock, Message(MsgType.METADATA, seq=seq), flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        deadline = time.monotonic() + min(self.timeout_s, METADATA_TIMEOUT_S)
        while (remaining := deadline - time.monotonic()) > 0 and sock.poll(int(remaining * 1000)):
            reply = recv(sock)
            if reply.seq == seq:
                declared = reply.meta.get("cuda_ipc")
                return declared if isinstance(declared, dict) else None
        log.warning(
            "%s did not say which GPU it runs on; weights go there as host buckets", self.addresses[i]
        )
        return False

    # ------------------------------------------------------------------- sending

    def _send(self, plans: list[list[Message]], check: bool) -> list[dict[str, Any]]:
        """Send each server its messages (``plans[i]``), bucket by bucket across servers,
        then collect one answer from each."""
        base = self._seq
        renumbered: set[int] = set()
        for plan in plans:
            for msg in plan:
                if msg.type is MsgType.WEIGHTS and id(msg) not in renumbered:
                    msg.seq = base + msg.seq
                    renumbered.add(id(msg))
        skipped: set[int] = set()
        for step in range(max((len(p) for p in plans), default=0)):
            for i, sock in enumerate(self._socks):
                if i in skipped or step >= len(plans[i]):
                    continue
                if not self.optional[i]:
                    send(sock, plans[i][step])
                    continue
                try:
                    send(sock, plans[i][step], flags=zmq.NOBLOCK)
                except zmq.Again:  # no server in this autoscaling slot now
                    skipped.add(i)
        self._seq = max([base, *(p[-1].seq for p in plans if p)])
        self.formats = [str(p[0].meta.get("format", "command")) if p else "" for p in plans]
        results = []
        for i, (sock, address) in enumerate(zip(self._socks, self.addresses)):
            if i in skipped:
                continue
            result = self._answer(sock, address, plans[i][0].seq, plans[i][-1].seq)
            if not result["ok"] and self.formats[i] == "cuda_ipc":
                self.gpu.forget(i)  # ask again: it may have restarted elsewhere or changed
            results.append(result)
        failed = [r for r in results if not r["ok"]]
        if check and failed:
            bad = failed[0]
            raise RemoteError(bad["code"], f"{bad['address']}: {bad['message']}", self._seq)
        return results

    def _answer(self, sock: zmq.Socket[Any], address: str, first: int, last: int) -> dict[str, Any]:
        """The one answer to messages ``first..last`` (an error may answer any bucket).

        The deadline is ``timeout_s`` from the start of the wait, read again every
        :data:`ANSWER_CHECK_S`: another thread that lowers ``timeout_s`` (a trainer told to
        stop) cuts a wait already in progress short."""
        started = time.monotonic()
        while True:
            remaining = started + self.timeout_s - time.monotonic()
            if remaining <= 0:
                raise Timeout(f"no answer to weights from {address} within {self.timeout_s} s")
            if not sock.poll(int(min(remaining, ANSWER_CHECK_S) * 1000) + 1):
                continue
            reply = recv(sock)
            if not first <= reply.seq <= last:
                continue  # a late answer to an earlier publication that timed out
            if reply.type is MsgType.ERROR:
                return {
                    "address": address,
                    "ok": False,
                    "code": reply.meta.get("code"),
                    "message": reply.meta.get("message"),
                }
            return {"address": address, "ok": True, **reply.meta}

    def close(self) -> None:
        for sock in self._socks:
            sock.close(linger=0)
        self._socks = []
        self.gpu.close()
