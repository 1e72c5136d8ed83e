"""The loopgate wire protocol: message types, the zero-copy codec and typed errors.

See :mod:`gateway.protocol.codec` for the frame layout.
"""

from gateway.protocol.codec import (
    ALLOWED_DTYPES,
    DEFAULT_LIMITS,
    Limits,
    decode,
    encode,
    recv,
    recv_frames,
    recv_routed,
    send,
    send_frames,
)
from gateway.protocol.errors import ErrorCode, ProtocolError, RemoteError, RunEnded, Timeout
from gateway.protocol.messages import (
    PROTOCOL_VERSION,
    Message,
    MsgType,
    error_message,
    pack,
    unpack,
)

__all__ = [
    "ALLOWED_DTYPES",
    "DEFAULT_LIMITS",
    "PROTOCOL_VERSION",
    "ErrorCode",
    "Limits",
    "Message",
    "MsgType",
    "ProtocolError",
    "RemoteError",
    "RunEnded",
    "Timeout",
    "decode",
    "encode",
    "error_message",
    "pack",
    "raise_for_error",
    "recv",
    "recv_frames",
    "recv_routed",
    "send",
    "send_frames",
    "unpack",
]


def raise_for_error(msg: Message) -> Message:
    """Return ``msg`` unless it is an ERROR, which is raised as :class:`RemoteError`
    (:class:`RunEnded` for ``run_ended``)."""
    if msg.type is MsgType.ERROR:
        code = str(msg.meta.get("code", "?"))
        kind = RunEnded if code == ErrorCode.RUN_ENDED.value else RemoteError
        raise kind(code, str(msg.meta.get("message", "")), msg.seq)
    return msg
