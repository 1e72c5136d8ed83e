"""The codec: :class:`Message` <-> multipart ZeroMQ frames, without copies.

Frame 0 is a msgpack map::

    {"v": PROTOCOL_VERSION, "t": <MsgType>, "s": <seq>, "m": {<meta>},
     "a": [[<key>, <dtype name>, [<dim>, ...]], ...]}

and frame ``i + 1`` holds the raw bytes of array ``i`` in C order. Arrays are sent
from their own memory (``copy=False``) and received as read-only views of the frame
buffers (``np.frombuffer``); nothing is pickled and object dtypes cannot be expressed.

Decoding checks everything a peer controls and raises :class:`ProtocolError` naming
the problem; it never raises anything else for any input (property-tested)::

    frames = encode(Message(MsgType.OBSERVATION, seq=7, arrays={"obs/q": q}))
    send_frames(sock, frames)
    msg = decode(recv_frames(sock), Limits())
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import numpy as np
import numpy.typing as npt
import zmq

from gateway.protocol.errors import ErrorCode, ProtocolError
from gateway.protocol.messages import PROTOCOL_VERSION, Message, MsgType

ALLOWED_DTYPES: frozenset[str] = frozenset(
    {
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
    }
)
"""Dtype names that may travel. Everything else (object, strings, structured,
big-endian, datetimes) is refused on both sides."""

MAX_NDIM = 8
_MSG_TYPES = {int(t): t for t in MsgType}
_DTYPES = {name: np.dtype(name) for name in ALLOWED_DTYPES}
_NAME_OF: dict[np.dtype[Any], str] = {dtype: name for name, dtype in _DTYPES.items()}


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Size limits a receiver enforces before it touches array data."""

    max_frames: int = 1024
    """Most frames in one message (header included)."""
    max_header_bytes: int = 1 << 20
    """Largest msgpack header frame."""
    max_frame_bytes: int = 256 << 20
    """Largest single array frame."""
    max_message_bytes: int = 1 << 30
    """Largest message, all frames together."""

    def __post_init__(self) -> None:
        for name in ("max_frames", "max_header_bytes", "max_frame_bytes", "max_message_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"limits.{name} must be a positive integer, got {value!r}")
        if self.max_frames < 1:
            raise ValueError(f"limits.max_frames must be >= 1, got {self.max_frames}")


DEFAULT_LIMITS = Limits()


def _array_frame(key: str, value: Any) -> tuple[list[Any], Any]:
    arr = value if type(value) is np.ndarray else np.asarray(value)
    # A dict lookup instead of ``dtype.name`` (slow Python code in numpy), which showed
    # up as a fifth of the cost of encoding a replay batch; big-endian dtypes are not
    # equal to the native ones and miss it.
    name = _NAME_OF.get(arr.dtype)
    if name is None:
        raise ProtocolError(ErrorCode.BAD_DTYPE, f"array {key!r} has dtype {arr.dtype} which cannot be sent")
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    shape = list(arr.shape)
    if not arr.ndim:
        arr = arr.reshape(1)
    if not arr.size:
        return [key, name, shape], b""
    # A bool array exports a buffer (format '?') that not every consumer of frames takes.
    return [key, name, shape], arr.view(np.uint8) if name == "bool" else arr


def encode(msg: Message) -> list[Any]:
    """Frames for ``msg``: the header, then one buffer per array (not copied)."""
    descr: list[list[Any]] = []
    frames: list[Any] = [b""]
    for key, value in msg.arrays.items():
        entry, data = _array_frame(key, value)
        descr.append(entry)
        frames.append(data)
    header = {"v": PROTOCOL_VERSION, "t": int(msg.type), "s": msg.seq, "m": msg.meta, "a": descr}
    try:
        frames[0] = _ENCODER.encode(header)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(ErrorCode.BAD_HEADER, f"metadata cannot be encoded: {exc}") from exc
    return frames


class FrameSocket(Protocol):
    """What the codec sends on and receives from: a ZeroMQ socket, or a local link's end
    (:mod:`gateway.local_link`), which takes and gives a message's frames in one call."""

    def send_multipart(self, msg_parts: Sequence[Any], flags: int = ...) -> Any: ...

    def recv_multipart(self, flags: int = ...) -> Any: ...


class BufferFrame:
    """A received frame that did not come through ZeroMQ (:mod:`gateway.local_link`): what
    :func:`recv_frames` and :func:`decode` use of a ``zmq.Frame``."""

    __slots__ = ("buffer", "more")

    def __init__(self, buffer: memoryview, more: bool) -> None:
        self.buffer = buffer
        self.more = more

    @property
    def bytes(self) -> bytes:
        return self.buffer.tobytes()


def _frame_buffer(frame: Any) -> memoryview:
    if isinstance(frame, (zmq.Frame, BufferFrame)):
        return frame.buffer
    return memoryview(frame)


def _check_shape(key: str, shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise ProtocolError(
            ErrorCode.BAD_SHAPE, f"array {key!r}: shape must be a list of at most {MAX_NDIM} dims"
        )
    dims: list[int] = []
    for dim in shape:
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
            raise ProtocolError(
                ErrorCode.BAD_SHAPE, f"array {key!r}: bad dimension {dim!r} in shape {shape!r}"
            )
        dims.append(dim)
    return tuple(dims)


class _Header(msgspec.Struct):
    """Frame 0 as it is parsed: each field is checked below, where its error is named;
    the array table stays raw msgpack, the key of :data:`_LAYOUTS`."""

    v: Any = None
    t: Any = None
    s: Any = 0
    m: dict[str, Any] = {}
    a: msgspec.Raw = msgspec.Raw(msgspec.msgpack.encode([]))


_PLAIN: tuple[type[Any], ...] = (str, float, int, bytes, dict, list, tuple)


def _plain(obj: Any) -> Any:
    """Meta values of a subclass of a plain type travel as that type (a ``numpy.float64``
    from a computation, ``torch.__version__``), as they always have; anything else
    (a numpy ``int64`` or ``float32``, an object) cannot be encoded."""
    for kind in _PLAIN:
        if isinstance(obj, kind):
            return kind(obj)
    raise TypeError(f"{type(obj).__name__} is not a msgpack scalar, list or map")


_HEADER = msgspec.msgpack.Decoder(_Header)
_ENCODER = msgspec.msgpack.Encoder(enc_hook=_plain)


@dataclass(frozen=True)
class _Layout:
    """A checked array table: ``(key, dtype, shape, bytes)`` per frame, the largest frame."""

    arrays: tuple[tuple[str, np.dtype[Any], tuple[int, ...], int], ...]
    largest: int


_LAYOUTS: dict[bytes, _Layout] = {}
"""Checked array tables by their msgpack bytes: a peer sends the same table with every
message of a kind, so it is checked once (16 -> 8 us to decode a five-array request)."""
MAX_LAYOUTS = 4096
"""Tables kept; past this the cache starts again (a peer cannot grow it without bound)."""


def _layout(raw: bytes) -> _Layout:
    """Check an array table (raise :class:`ProtocolError` naming its problem)."""
    try:
        descr = msgspec.msgpack.decode(raw)
    except Exception:  # the header around it parsed, so this is not expected
        raise ProtocolError(ErrorCode.BAD_HEADER, "array table 'a' is not msgpack") from None
    if not isinstance(descr, list):
        raise ProtocolError(ErrorCode.BAD_HEADER, "array table 'a' must be a list")
    arrays: list[tuple[str, np.dtype[Any], tuple[int, ...], int]] = []
    seen: set[str] = set()
    for entry in descr:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)):
            raise ProtocolError(ErrorCode.BAD_HEADER, f"array entry {entry!r} must be [key, dtype, shape]")
        key, dtype_name, shape_raw = entry
        if key in seen:
            raise ProtocolError(ErrorCode.BAD_HEADER, f"array key {key!r} appears twice")
        seen.add(key)
        dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise ProtocolError(ErrorCode.BAD_DTYPE, f"array {key!r}: dtype {dtype_name!r} is not allowed")
        shape = _check_shape(key, shape_raw)
        arrays.append((key, dtype, shape, math.prod(shape) * dtype.itemsize))
    return _Layout(tuple(arrays), max((a[3] for a in arrays), default=0))


def decode(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Parse and validate frames into a :class:`Message`; raise :class:`ProtocolError`."""
    if not frames:
        raise ProtocolError(ErrorCode.TRUNCATED, "empty message: no header frame")
    if len(frames) > limits.max_frames:
        raise ProtocolError(
            ErrorCode.TOO_LARGE, f"{len(frames)} frames is over the limit of {limits.max_frames}"
        )
    head = _frame_buffer(frames[0])
    if head.nbytes > limits.max_header_bytes:
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"header of {head.nbytes} bytes is over the limit of {limits.max_header_bytes}",
        )
    try:
        header = _HEADER.decode(head)
    except msgspec.ValidationError as exc:  # not a map, string keys or a meta map
        raise ProtocolError(
            ErrorCode.BAD_HEADER, f"header must be a map with string keys and a map 'm' ({exc})"
        ) from None
    except Exception as exc:  # malformed msgpack (msgspec raises DecodeError, and others on nesting)
        raise ProtocolError(
            ErrorCode.BAD_HEADER, f"header frame is not msgpack: {type(exc).__name__}"
        ) from None
    version = header.v
    if version != PROTOCOL_VERSION or isinstance(version, bool):
        raise ProtocolError(
            ErrorCode.BAD_VERSION,
            f"protocol version {version!r} is not supported (this peer speaks {PROTOCOL_VERSION})",
        )
    type_code = header.t
    msg_type = _MSG_TYPES.get(type_code) if isinstance(type_code, int) else None
    if msg_type is None:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {type_code!r}")
    seq = header.s
    if not isinstance(seq, int) or isinstance(seq, bool):
        raise ProtocolError(ErrorCode.BAD_HEADER, f"sequence number must be an integer, got {seq!r}")
    meta = header.m
    raw = bytes(header.a)
    layout = _LAYOUTS.get(raw)
    if layout is None:
        layout = _layout(raw)
        if len(_LAYOUTS) >= MAX_LAYOUTS:
            _LAYOUTS.clear()
        _LAYOUTS[raw] = layout
    if len(layout.arrays) != len(frames) - 1:
        raise ProtocolError(
            ErrorCode.TRUNCATED,
            f"header announces {len(layout.arrays)} arrays but {len(frames) - 1} frames follow it",
        )
    if layout.largest > limits.max_frame_bytes:
        key, _, shape, expected = next(a for a in layout.arrays if a[3] > limits.max_frame_bytes)
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"array {key!r} of shape {list(shape)} needs {expected} bytes, over the frame limit of "
            f"{limits.max_frame_bytes}",
        )
    arrays: dict[str, npt.NDArray[Any]] = {}
    total = head.nbytes
    for (key, dtype, shape, expected), frame in zip(layout.arrays, frames[1:]):
        buf = _frame_buffer(frame)
        if buf.nbytes != expected:
            if buf.nbytes > limits.max_frame_bytes:
                raise ProtocolError(
                    ErrorCode.TOO_LARGE,
                    f"frame for array {key!r} has {buf.nbytes} bytes, over the limit of "
                    f"{limits.max_frame_bytes}",
                )
            raise ProtocolError(
                ErrorCode.LENGTH_MISMATCH,
                f"array {key!r}: frame has {buf.nbytes} bytes but {dtype.name}{list(shape)} needs {expected}",
            )
        total += expected
        # ndarray over the frame's buffer: half of frombuffer + reshape (0.4 against 0.8 us).
        arrays[key] = np.ndarray(shape, dtype, buf) if expected else np.zeros(shape, dtype)
    if total > limits.max_message_bytes:
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"message is over the limit of {limits.max_message_bytes} bytes",
        )
    return Message(msg_type, seq=seq, meta=meta, arrays=arrays)


_SNDMORE = int(zmq.SNDMORE)


def send_frames(sock: FrameSocket, frames: Sequence[Any], flags: int = 0) -> None:
    """``sock.send_multipart(frames, flags, copy=False)``: arrays leave from their own
    memory (pyzmq still copies frames under its ``copy_threshold``).

    pyzmq's own does an enum operation per frame (``SNDMORE | flags``), which costs more
    than sending the frame: 6.1 against 2.5 us for a four-frame action.
    """
    if not frames:
        raise ValueError("a message has at least one frame")
    if not isinstance(sock, zmq.Socket):  # a local link: the whole message at once
        sock.send_multipart(frames, flags)
        return
    flags = int(flags)
    more = flags | _SNDMORE
    last = len(frames) - 1
    for i in range(last):
        sock.send(frames[i], more, copy=False)
    sock.send(frames[last], flags, copy=False)


def recv_frames(sock: FrameSocket, flags: int = 0) -> list[Any]:
    """``sock.recv_multipart(flags, copy=False)``, asking each frame whether more follow
    (``Frame.more``) instead of the socket (``RCVMORE``, an enum-typed option): 3.2
    against 7.7 us for a five-frame observation. A multipart message arrives whole, so
    its later frames never wait. A local link gives :class:`BufferFrame` s instead of
    ``zmq.Frame`` s."""
    if not isinstance(sock, zmq.Socket):  # a local link: the whole message at once
        whole: list[Any] = sock.recv_multipart(flags)
        return whole
    flags = int(flags)
    frame = sock.recv(flags, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(flags, copy=False)
        frames.append(frame)
    return frames


def send(sock: FrameSocket, msg: Message, route: Sequence[bytes] = (), flags: int = 0) -> None:
    """Send ``msg`` (after optional ROUTER routing frames) without copying arrays."""
    frames = encode(msg)
    if route:
        frames = [*route, *frames]
    send_frames(sock, frames, flags)


def recv(sock: FrameSocket, limits: Limits = DEFAULT_LIMITS, flags: int = 0) -> Message:
    """Receive and decode one message from a DEALER/PAIR-style socket."""
    return decode(recv_frames(sock, flags), limits)


def recv_routed(
    sock: FrameSocket, limits: Limits = DEFAULT_LIMITS, flags: int = 0
) -> tuple[bytes, Message | None, ProtocolError | None]:
    """Receive on a ROUTER: ``(peer id, message or None, error or None)``.

    The routing frame is split off before decoding so a malformed message can still
    be answered to the peer that sent it.
    """
    frames = recv_frames(sock, flags)
    peer = frames[0].bytes
    try:
        return peer, decode(frames[1:], limits), None
    except ProtocolError as exc:
        return peer, None, exc
