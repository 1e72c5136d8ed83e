"""A stand-in for CUDA on machines without a GPU, for :mod:`gateway.cuda_ipc`'s tests.

CUDA cannot run on a CPU machine, so :class:`CpuStandIn` replaces the one class that
calls it (:class:`gateway.cuda_ipc.TorchCuda`): CPU tensors play device memory, and a
table in this process plays the driver's IPC handles (so producer and consumer must be
in one process). Everything else (descriptors, checks, the ring, caches, the wire, the
gateway, the inference server and the backends) is the product's own code. The
``standin`` fixture (``tests/conftest.py``) puts it in place for one test. Tests that
need real CUDA are in ``tests/test_cuda_ipc_gpu.py``.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any

import torch

UUID = "GPU-standin-0000"


@dataclass
class StandInEvent:
    handle: bytes
    recorded: int = 0
    waited: int = 0


class CpuStandIn:
    """What :class:`~gateway.cuda_ipc.TorchCuda` does, on the CPU (see the module docstring)."""

    def __init__(self, *, events: bool = True) -> None:
        self.torch = torch
        self.events = events
        self.storages: dict[bytes, Any] = {}
        self.event_table: dict[bytes, StandInEvent] = {}
        self.shared = 0
        self.opened = 0
        self.syncs = 0
        self._refs = itertools.count()

    def why_unavailable(self) -> str | None:
        return None

    def is_device(self, device: Any) -> bool:
        return torch.device(device).type == "cpu"

    def index(self, device: Any) -> int:
        return 0

    def uuid(self, index: int) -> str | None:
        return UUID

    def empty(self, shape: tuple[int, ...], dtype: str, index: int) -> Any:
        return torch.empty(shape, dtype=getattr(torch, dtype))

    def share(self, tensor: Any) -> list[Any]:
        storage = tensor.untyped_storage()
        handle = b"\x01" + os.urandom(64)
        self.storages[handle] = storage
        self.shared += 1
        ref = f"/torch_{os.getpid()}_standin".encode()
        return [0, handle, storage.nbytes(), 0, ref, next(self._refs), bytes(64), False]

    def open(self, index: int, storage: list[Any]) -> Any:
        found = self.storages.get(storage[1])
        if found is None:
            raise RuntimeError("CUDA error: invalid argument (stand-in: no such handle)")
        self.opened += 1
        return found

    def new_event(self, index: int) -> tuple[Any, bytes] | None:
        if not self.events:
            return None
        event = StandInEvent(os.urandom(64))
        self.event_table[event.handle] = event
        return event, event.handle

    def record(self, event: StandInEvent, index: int) -> None:
        event.recorded += 1

    def synchronize(self, index: int) -> None:
        self.syncs += 1

    def open_event(self, index: int, handle: bytes) -> Any:
        found = self.event_table.get(handle)
        if found is None:
            raise RuntimeError("CUDA error: invalid resource handle (stand-in: no such event)")
        return found

    def wait(self, event: StandInEvent, index: int) -> None:
        event.waited += 1
