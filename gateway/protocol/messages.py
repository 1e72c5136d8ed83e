"""Message types and the in-memory message.

A :class:`Message` is what the codec turns a multipart ZeroMQ message into: a type, a
sequence number, a small metadata map (msgpack scalars, lists and maps only) and a map
of named numpy arrays, each of which travels as its own raw frame.

Nested observation dicts are flattened with :func:`pack` / :func:`unpack` under a
prefix, e.g. ``obs/joint_pos``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import numpy.typing as npt

PROTOCOL_VERSION = 1
"""Bumped on any incompatible change of the header or of a message's meaning."""


class MsgType(IntEnum):
    """Every message type; values travel on the wire and are never reused."""

    HELLO = 1
    """Peer introduces itself (worker: its spec; client: what it wants)."""
    WELCOME = 2
    """Answer to HELLO: accepted, with the session's parameters."""
    RESET = 3
    """Ask for a reset (client to gateway, gateway to worker)."""
    STEP = 4
    """Client to gateway: an action for the envs the client controls."""
    OBSERVATION = 5
    """A batch of observations, with the results of the previous step."""
    ACTION = 6
    """A batch of actions with the policy version that produced them."""
    TRAJECTORY_CHUNK = 7
    """Contiguous steps of one episode, on their way to a trajectory sink."""
    CHUNK_ACK = 8
    """The sink stored a chunk durably."""
    WEIGHTS = 9
    """A bucket of policy weights (or an ONNX blob) with a version."""
    WEIGHTS_ACK = 10
    """The receiver validated and installed (or staged) the weights."""
    HEARTBEAT = 11
    """Liveness, in both directions."""
    ERROR = 12
    """A typed error answering a message (code, message, ref = its seq)."""
    BYE = 13
    """A peer leaves cleanly."""
    COMMAND = 14
    """A control-plane request: status, pause, e-stop, ... (``meta['cmd']``)."""
    REPLY = 15
    """Answer to COMMAND."""
    METADATA = 16
    """Ask a service to describe itself; the answer is a REPLY."""
    SAMPLE = 17
    """Ask a replay table for a batch."""
    BATCH = 18
    """A sampled batch."""
    HELD = 19
    """The gateway holds a client's request (pause, e-stop, budget, backpressure): meta
    ``reason`` and ``message``; repeated while held, and the answer follows once it lifts."""
    INFER = 20
    """A batch of observations for an inference server; answered with an ACTION."""


@dataclass(slots=True)
class Message:
    """One protocol message: header fields plus named arrays."""

    type: MsgType
    seq: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, npt.NDArray[Any]] = field(default_factory=dict)


def pack(prefix: str, arrays: Mapping[str, npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]:
    """Flatten a dict of arrays under ``prefix/`` for a :class:`Message`."""
    return {f"{prefix}/{key}": value for key, value in arrays.items()}


def unpack(prefix: str, arrays: Mapping[str, npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]:
    """Inverse of :func:`pack`: the arrays under ``prefix/`` with the prefix removed."""
    start = len(prefix) + 1
    return {key[start:]: value for key, value in arrays.items() if key.startswith(prefix + "/")}


def error_message(code: str, message: str, ref: int = 0) -> Message:
    """An ``ERROR`` message answering the message whose seq is ``ref``."""
    return Message(MsgType.ERROR, seq=ref, meta={"code": code, "message": message, "ref": ref})
