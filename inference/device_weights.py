"""Weights on one GPU: which servers take a CUDA IPC publication, and its WEIGHTS message.

:class:`~inference.weights.WeightsPublisher` learns once per server which GPU it takes
handles for (``cuda_ipc`` in its METADATA answer: host and GPU UUID) and sends a state
dict of CUDA tensors to those on its own GPU as one WEIGHTS message of handles (format
``cuda_ipc``); the others get host buckets of the same version::

    route = DeviceRoute()
    device = common_device(state_dict)                  # None: not all tensors on one GPU
    if device is not None and route.same_gpu(i, device, ask=lambda: ask_metadata(i)):
        msg = route.message(state_dict, version)        # copied into staging, shared once

The staging buffers (:class:`gateway.cuda_ipc.Staging`) are overwritten by the next
publication: the publisher sends one only after every server answered the last.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from typing import Any

from gateway.cuda_ipc import Staging, device_of, log_once, same_device
from gateway.protocol import Message, MsgType
from gateway.shm import host_identity

Declaration = dict[str, Any] | bool | None
"""A server's ``cuda_ipc`` declaration, None when it takes no handles, False when it did
not answer (asked again next time)."""


def common_device(state_dict: Mapping[str, Any]) -> Any | None:
    """The device every value of ``state_dict`` is a torch tensor on, or None."""
    devices = {device_of(v) for v in state_dict.values()}
    return devices.pop() if len(devices) == 1 else None


class DeviceRoute:
    """Per server, whether it shares the publisher's GPU; the staging buffers for it."""

    def __init__(self) -> None:
        self.declared: dict[int, dict[str, Any] | None] = {}
        """Per server: the GPU it takes handles for (None: none), once it answered."""
        self.staging: Staging | None = None

    def same_gpu(self, i: int, device: Any, ask: Callable[[], Declaration]) -> bool:
        """Whether server ``i`` declared the GPU the tensors are on (``ask`` once)."""
        if self.staging is None or self.staging.ops.index(device) != self.staging.index:
            try:
                self.staging = Staging(device)
            except (ValueError, RuntimeError) as exc:
                log_once("weights go as host buckets: no CUDA IPC from here (%s)", exc)
                return False
        if i not in self.declared:
            declared = ask()
            if isinstance(declared, bool):
                return False  # no answer now: host buckets this time, ask again next time
            self.declared[i] = declared
        return same_device(self.declared[i], {"host": host_identity(), "uuid": self.staging.uuid})

    def forget(self, i: int) -> None:
        """Ask server ``i`` again next time (it moved, or refused a handle)."""
        self.declared.pop(i, None)

    def message(self, state_dict: Mapping[str, Any], version: int) -> Message:
        """The one WEIGHTS message of a ``cuda_ipc`` publication (seq 1 of its transfer)."""
        assert self.staging is not None, "same_gpu() first"
        meta = {
            "version": version,
            "format": "cuda_ipc",
            "transfer": uuid.uuid4().hex[:12],
            "bucket": 0,
            "buckets": 1,
            "tensors": len(state_dict),
            "bytes": sum(t.numel() * t.element_size() for t in state_dict.values()),
            "parts": {},
            "cuda_ipc": self.staging.handle(state_dict),
        }
        return Message(MsgType.WEIGHTS, seq=1, meta=meta)

    def close(self) -> None:
        self.staging = None
