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
"""

from __future__ import annotations

import contextlib
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

from gateway.protocol import ErrorCode, Message, MsgType, ProtocolError, RemoteError, Timeout, recv, send
from gateway.transport import CurveKeys, connect, make_socket

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 32 << 20
"""Array bytes per WEIGHTS message: large enough to amortise, small enough to pipeline."""
MAX_TENSORS_PER_BUCKET = 1000
"""Stays below the codec's default frame limit (1024 frames per message)."""
ONNX_KEY = "onnx"


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
        if fmt not in ("state_dict", "onnx"):
            raise WeightsError(ErrorCode.BAD_WEIGHTS, f"unknown weights format {fmt!r}")
        if self._dropped.get(route) == transfer:
            return None  # the rest of a transfer already refused
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


def check_state_dict(
    arrays: Mapping[str, np.ndarray],
    expected: Mapping[str, tuple[str, tuple[int, ...]]],
    *,
    check_finite: bool = True,
) -> None:
    """Raise ``bad_weights`` unless ``arrays`` has exactly the expected names, dtypes and shapes, all finite."""
    missing = sorted(set(expected) - set(arrays))
    unexpected = sorted(set(arrays) - set(expected))
    if missing or unexpected:
        raise WeightsError(
            ErrorCode.BAD_WEIGHTS,
            f"state dict does not fit the network: missing {missing[:5]}, unexpected {unexpected[:5]}",
        )
    for name, (dtype, shape) in expected.items():
        arr = arrays[name]
        if arr.dtype.name != dtype or tuple(arr.shape) != tuple(shape):
            raise WeightsError(
                ErrorCode.BAD_WEIGHTS,
                f"tensor {name!r} is {arr.dtype}{list(arr.shape)}, the network needs {dtype}{list(shape)}",
            )
        if check_finite and arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise WeightsError(ErrorCode.BAD_WEIGHTS, f"tensor {name!r} has NaN or Inf values")


# ---------------------------------------------------------------------- publisher


def weights_addresses(targets: Sequence[str | Mapping[str, Any]]) -> list[str]:
    """Addresses from plain strings or ``endpoints.json`` inference entries."""
    return [t if isinstance(t, str) else str(t["weights"]) for t in targets]


class WeightsPublisher:
    """Sends versioned weights to inference servers and waits for every answer (one result
    per server, autoscaling slots with no server left out)."""

    def __init__(
        self,
        targets: Sequence[str | Mapping[str, Any]],
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        keys: CurveKeys | None = None,
        timeout_s: float = 60.0,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.addresses = weights_addresses(targets)
        self.optional = [isinstance(t, Mapping) and bool(t.get("autoscaled")) for t in targets]
        """Autoscaling slots: a server runs there only while load needs it. A publication
        skips one that is not connected (it catches up at the next one) instead of waiting
        for it; a planned server that is restarting gets its publication queued, as ever."""
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
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
            moved.append(f"weights of inference server {i}: {old} -> {new}")
            log.warning("inference server %d moved: publishing its weights to %s (was %s)", i, new, old)
        return moved

    def publish(
        self, state_dict: Mapping[str, np.ndarray], version: int, *, check: bool = True
    ) -> list[dict[str, Any]]:
        """Send a state dict (numpy arrays) as ``version``; one result per server."""
        return self._send(transfer_messages(state_dict, version, "state_dict", self.bucket_bytes), check)

    def publish_onnx(
        self, blob: bytes | np.ndarray, version: int, *, check: bool = True
    ) -> list[dict[str, Any]]:
        """Send a serialised ONNX model as ``version``; one result per server."""
        arr = (
            np.frombuffer(blob, dtype=np.uint8) if isinstance(blob, (bytes, bytearray, memoryview)) else blob
        )
        return self._send(transfer_messages({ONNX_KEY: arr}, version, "onnx", self.bucket_bytes), check)

    def rollback(self, *, check: bool = True) -> list[dict[str, Any]]:
        """Every server swaps its previous version back in."""
        self._seq += 1
        return self._send([Message(MsgType.COMMAND, seq=self._seq, meta={"cmd": "rollback"})], check)

    def _send(self, messages: list[Message], check: bool) -> list[dict[str, Any]]:
        base = self._seq
        skipped: set[int] = set()
        for msg in messages:
            msg.seq = base + msg.seq if msg.type is MsgType.WEIGHTS else msg.seq
            for i, sock in enumerate(self._socks):
                if i in skipped:
                    continue
                if not self.optional[i]:
                    send(sock, msg)
                    continue
                try:
                    send(sock, msg, flags=zmq.NOBLOCK)
                except zmq.Again:  # no server in this autoscaling slot now
                    skipped.add(i)
        first, last = messages[0].seq, messages[-1].seq
        self._seq = last
        results = [
            self._answer(sock, address, first, last)
            for i, (sock, address) in enumerate(zip(self._socks, self.addresses))
            if i not in skipped
        ]
        failed = [r for r in results if not r["ok"]]
        if check and failed:
            bad = failed[0]
            raise RemoteError(bad["code"], f"{bad['address']}: {bad['message']}", last)
        return results

    def _answer(self, sock: zmq.Socket[Any], address: str, first: int, last: int) -> dict[str, Any]:
        """The one answer to messages ``first..last`` (an error may answer any bucket)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sock.poll(int(remaining * 1000)):
                raise Timeout(f"no answer to weights from {address} within {self.timeout_s} s")
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
