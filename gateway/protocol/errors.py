"""Typed errors that cross sockets.

Every problem a peer can cause is a :class:`ProtocolError` with a stable
:class:`ErrorCode` and a message a person can act on. A receiver answers it with an
``ERROR`` message (see :func:`gateway.protocol.messages.error_message`); the caller turns
that message back into a :class:`RemoteError` with :func:`raise_for_error`.
"""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    """Stable error codes; their string values travel on the wire."""

    TRUNCATED = "truncated"
    """The multipart message has fewer or more frames than its header announces."""
    BAD_HEADER = "bad_header"
    """Frame 0 is not a msgpack map of the expected shape."""
    BAD_VERSION = "bad_version"
    """The header names a protocol version this peer does not speak."""
    UNKNOWN_TYPE = "unknown_type"
    """The header names a message type this peer does not know."""
    BAD_DTYPE = "bad_dtype"
    """An array dtype is not in the whitelist (object, big-endian, unknown)."""
    BAD_SHAPE = "bad_shape"
    """An array shape is not a short list of non-negative integers."""
    LENGTH_MISMATCH = "length_mismatch"
    """An array frame's byte length differs from shape x itemsize."""
    TOO_LARGE = "too_large"
    """A frame, the header or the whole message is over the configured limit."""
    BAD_REQUEST = "bad_request"
    """The message decoded but its contents are wrong for this request."""
    UNEXPECTED = "unexpected"
    """The message type is valid but not in this state or on this socket."""
    SPEC_MISMATCH = "spec_mismatch"
    """A worker's env spec differs from the experiment's."""
    NOT_REGISTERED = "not_registered"
    """The peer sent data before a successful HELLO."""
    DEADLINE_EXCEEDED = "deadline_exceeded"
    """The request's deadline passed before an answer was ready."""
    BAD_WEIGHTS = "bad_weights"
    """Weights were refused (shapes, dtypes, non-finite values, truncated blob)."""
    STALE_VERSION = "stale_version"
    """A policy version older than (or equal to) the current one."""
    UNAVAILABLE = "unavailable"
    """The service cannot serve this now (paused, no capacity, no worker free)."""
    RATE_LIMITED = "rate_limited"
    """A rate limiter holds the request back."""
    STORAGE = "storage"
    """Durable storage failed (disk full, I/O error)."""
    RUN_ENDED = "run_ended"
    """The run is stopping (draining): no further steps are taken."""
    INTERNAL = "internal"
    """A bug on the answering side; its log has the details."""


class ProtocolError(Exception):
    """A problem caused by a peer's message, answerable with an ``ERROR`` message."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"[{code.value}] {message}")
        self.code = code
        self.message = message


class RemoteError(Exception):
    """An ``ERROR`` message received from a peer, raised at the caller."""

    def __init__(self, code: str, message: str, ref: int = 0) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message
        self.ref = ref


class RunEnded(RemoteError):
    """The gateway's run is over (its step budget was spent, or it is stopping): a
    script driving it should end its loop."""


class Timeout(Exception):
    """A blocking call passed its deadline without an answer."""
