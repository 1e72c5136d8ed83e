"""CUDA IPC: observations and weights that stay on one GPU between processes.

When an env worker's simulator, the inference server (and the trainer) share one GPU,
tensors need not travel through the host: the producer shares a device buffer once
(``torch.UntypedStorage._share_cuda_``: a CUDA memory handle and torch's ref counter, as
``torch.multiprocessing`` does), the consumer opens it once (``_new_shared_cuda``) and
reads it in place. Handles travel as msgpack values (bytes, ints, strings) in message
meta, never pickled::

    # env worker (producer)                          # gateway (no torch)
    ring = CudaRing.create(layout, "cuda:0")
    HELLO meta["cuda_ipc"] = ring.offer()       ->   offer = RingOffer.parse(meta["cuda_ipc"])
                                                <-   WELCOME meta["cuda_ipc"] = {"ok": True}
    step = ring.write(seq, device_obs)  # copy + event
    OBSERVATION meta["cuda_ipc"] = step         ->   INFER meta["cuda_ipc"] = offer.handle(step)
                                                     # inference server (consumer)
                                                     reader = DeviceReader.for_device("auto", "cuda:0")
                                                     tensors = reader.open(reader.check(handle))

- **Ring.** One buffer per key per slot, allocated and shared once; a step costs a
  device-to-device copy into slot ``seq % slots`` and an event recorded after it, before
  the message leaves. The consumer waits on that event before it reads. Where
  interprocess events are not to be had, the producer synchronises its stream instead.
  The producer keeps every slot for the ring's life: a buffer a consumer may read is
  never freed or reused for something else. A worker writes a slot again only after the
  ACTION for the observation in it, which the inference server sends after its forward
  pass read it, so ``slots >= 2`` suffices.
- **Checks.** A handle is checked like a frame (dtype whitelist, shapes, the view inside
  its storage, sizes within ``Limits``, the same host and the same GPU by UUID); bad
  input is a :class:`ProtocolError` naming the problem.
- **Availability.** torch with CUDA, the same host (:func:`gateway.shm.host_identity`) and
  the same device (UUID); anything else falls back to shared memory or frames, logged
  once. torch is imported only when a GPU path is asked for. Every process is its own
  interpreter (never forked after CUDA started), as CUDA IPC requires.
- **Staging** (weights): :class:`Staging` copies a state dict into buffers shared once and
  returns one handle; the consumer (:meth:`DeviceReader.copy_out`) copies them
  device-to-device into its own tensors before it acknowledges.

The CUDA calls are in :class:`TorchCuda`, one place (:func:`ops`); what a handle holds and
how it is checked, without torch, in :mod:`gateway.cuda_handles`.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np

from gateway.cuda_handles import (
    MAX_SLOTS,
    VERSION,
    ArrayHandle,
    DeviceHandle,
    RingOffer,
    check_handle,
    handle_dict,
    parse_arrays,
    same_device,
)
from gateway.protocol import ErrorCode, ProtocolError
from gateway.protocol.codec import ALLOWED_DTYPES, DEFAULT_LIMITS, Limits
from gateway.shm import host_identity, is_local

__all__ = [
    "ArrayHandle",
    "CudaRing",
    "DeviceHandle",
    "DeviceReader",
    "RingOffer",
    "Staging",
    "TorchCuda",
    "check_handle",
    "device_of",
    "dtype_name",
    "ops",
    "parse_arrays",
    "same_device",
    "wanted",
    "why_unavailable",
]

log = logging.getLogger(__name__)

SLOTS = 4
CACHE_SIZE = 1024
"""Storages (and events) a consumer keeps open: a ring's slots, a publisher's staging buffers."""
_logged: set[str] = set()


def log_once(text: str, *args: Any, level: int = logging.INFO) -> None:
    """Log a reason for a fallback once per process (every step would repeat it)."""
    line = text % args if args else text
    if line not in _logged:
        _logged.add(line)
        log.log(level, line)


# --------------------------------------------------------------------------- CUDA


class TorchCuda:
    """The CUDA calls of this module (torch imported here, on first use)."""

    def __init__(self) -> None:
        import torch

        self.torch: Any = torch

    def why_unavailable(self) -> str | None:
        if not self.torch.cuda.is_available():
            return f"torch {self.torch.__version__} sees no CUDA device"
        return None

    def is_device(self, device: Any) -> bool:
        return bool(self.torch.device(device).type == "cuda")

    def index(self, device: Any) -> int:
        d = self.torch.device(device)
        return int(d.index if d.index is not None else self.torch.cuda.current_device())

    def uuid(self, index: int) -> str | None:
        """The GPU's UUID (indices differ between processes with other CUDA_VISIBLE_DEVICES)."""
        props = self.torch.cuda.get_device_properties(index)
        uuid = getattr(props, "uuid", None)
        if uuid is not None:
            return str(uuid)
        bus = getattr(props, "pci_bus_id", None)
        if bus is None:
            return None
        return f"pci-{getattr(props, 'pci_domain_id', 0)}:{bus}:{getattr(props, 'pci_device_id', 0)}"

    def empty(self, shape: tuple[int, ...], dtype: str, index: int) -> Any:
        return self.torch.empty(shape, dtype=getattr(self.torch, dtype), device=f"cuda:{index}")

    def share(self, tensor: Any) -> list[Any]:
        """The storage's IPC descriptor: what ``reduce_tensor`` pickles, as plain values."""
        device, handle, size, offset, ref, ref_offset, event, sync = tensor.untyped_storage()._share_cuda_()
        return [
            int(device),
            bytes(handle),
            int(size),
            int(offset),
            bytes(ref),
            int(ref_offset),
            bytes(event),
            bool(sync),
        ]

    def open(self, index: int, storage: list[Any]) -> Any:
        """A storage opened from :meth:`share`'s descriptor on this process's device ``index``."""
        _, handle, size, offset, ref, ref_offset, event, sync = storage
        self.torch.cuda._lazy_init()
        return self.torch.UntypedStorage._new_shared_cuda(
            index, handle, size, offset, ref, ref_offset, event, sync
        )

    def new_event(self, index: int) -> tuple[Any, bytes] | None:
        """An interprocess event and its handle; None where the driver refuses one."""
        try:
            with self.torch.cuda.device(index):
                event = self.torch.cuda.Event(interprocess=True)
                return event, bytes(event.ipc_handle())
        except RuntimeError as exc:
            log_once("no interprocess CUDA events (%s); producers synchronise instead", exc)
            return None

    def record(self, event: Any, index: int) -> None:
        event.record(self.torch.cuda.current_stream(index))

    def synchronize(self, index: int) -> None:
        self.torch.cuda.current_stream(index).synchronize()

    def open_event(self, index: int, handle: bytes) -> Any:
        return self.torch.cuda.Event.from_ipc_handle(self.torch.device("cuda", index), handle)

    def wait(self, event: Any, index: int) -> None:
        event.wait(self.torch.cuda.current_stream(index))


_OPS: Any = None


def ops() -> Any:
    """The CUDA calls (:class:`TorchCuda`); raises ImportError without torch."""
    global _OPS
    if _OPS is None:
        _OPS = TorchCuda()
    return _OPS


def why_unavailable() -> str | None:
    """Why CUDA IPC cannot work in this process (None: it can)."""
    try:
        return ops().why_unavailable()  # type: ignore[no-any-return]
    except ImportError:
        return "torch is not installed"


def device_of(value: Any) -> Any | None:
    """A torch tensor's device, or None for anything else (numpy arrays included)."""
    if isinstance(value, np.ndarray) or not hasattr(value, "untyped_storage"):
        return None
    return value.device


def dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def view(storage: Any, dtype: str, shape: tuple[int, ...], stride: tuple[int, ...], offset: int) -> Any:
    """A tensor over an opened storage (as ``rebuild_cuda_tensor`` builds it)."""
    torch = ops().torch
    empty = torch.empty(0, dtype=getattr(torch, dtype), device=storage.device)
    return empty.set_(storage, offset, shape, stride)


def wanted(mode: str, address: str) -> bool:
    """Whether a worker offers a ring for ``gateway.cuda_ipc`` = ``mode`` to a gateway at
    ``address`` (``auto``: a local address; ``on``: always; the gateway checks the host)."""
    return mode == "on" or (mode == "auto" and is_local(address))


def _unusable(device: Any) -> str | None:
    """Why tensors on ``device`` cannot be shared here (None: they can)."""
    why = why_unavailable()
    if why is not None:
        return why
    if not ops().is_device(device):
        return f"the tensors are on {device}, not on a GPU"
    if ops().uuid(ops().index(device)) is None:
        return f"{device} reports no UUID, so another process cannot tell it is the same GPU"
    return None


# --------------------------------------------------------------------- producer


class CudaRing:
    """The producer's ring: ``slots`` sets of device buffers, each shared once."""

    def __init__(self, index: int, uuid: str, buffers: list[dict[str, Any]], events: list[Any]) -> None:
        self.ops = ops()
        self.index, self.uuid = index, uuid
        self.buffers = buffers
        """Per slot: key -> the device tensor held for the ring's life (keep-alive)."""
        self.shared = [
            [
                [k, dtype_name(t), list(t.shape), list(t.stride()), t.storage_offset(), self.ops.share(t)]
                for k, t in slot.items()
            ]
            for slot in buffers
        ]
        self.events = events
        """Per slot: ``(event, handle)``, or None where the stream is synchronised instead."""
        self.accepted = False
        self.bytes_shared = 0
        """Array bytes handed over as handles so far."""

    @property
    def slots(self) -> int:
        return len(self.buffers)

    @classmethod
    def create(
        cls, layout: Mapping[str, tuple[str, tuple[int, ...]]], device: Any, slots: int = SLOTS
    ) -> CudaRing:
        """Buffers for ``layout`` (key -> (dtype, shape)) on ``device``; ValueError saying why not."""
        why = _unusable(device)
        if why is not None:
            raise ValueError(why)
        if not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"slots must be in 1..{MAX_SLOTS}, got {slots}")
        bad = [
            k for k, (dtype, shape) in layout.items() if dtype not in ALLOWED_DTYPES or not math.prod(shape)
        ]
        if bad or not layout:
            raise ValueError(
                f"nothing to share for {bad or 'an empty layout'} (unsupported dtype or no elements)"
            )
        o = ops()
        index = o.index(device)
        buffers = [
            {k: o.empty(tuple(shape), dtype, index) for k, (dtype, shape) in layout.items()}
            for _ in range(slots)
        ]
        return cls(index, o.uuid(index), buffers, [o.new_event(index) for _ in range(slots)])

    @classmethod
    def for_worker(cls, mode: str, address: str, backend: Any) -> CudaRing | None:
        """The ring an env worker offers (``gateway.cuda_ipc`` = ``mode``, gateway at
        ``address``), or None: not wanted, the backend's observations are not on a GPU,
        or CUDA is not to be had (logged once)."""
        device = getattr(backend, "observation_device", None)
        if device is None or not wanted(mode, address):
            return None
        n = backend.num_envs
        layout = {k: (a.dtype, (n, *a.shape)) for k, a in backend.spec.observation.items()}
        try:
            return cls.create(layout, device)
        except (ValueError, RuntimeError) as exc:  # RuntimeError: out of device memory
            log_once("no CUDA IPC ring (%s); observations go by shared memory or frames", exc)
            return None

    def offer(self) -> dict[str, Any]:
        """What HELLO carries in ``meta["cuda_ipc"]``."""
        return {
            "v": VERSION,
            "host": host_identity(),
            "uuid": self.uuid,
            "pid": os.getpid(),
            "slots": self.slots,
            "slot_arrays": self.shared,
        }

    def answered(self, answer: Any) -> bool:
        """WELCOME's ``meta["cuda_ipc"]``: whether the gateway takes handles from now on."""
        self.accepted = isinstance(answer, dict) and bool(answer.get("ok"))
        if self.accepted:
            log.info(
                "observations also go to same-GPU inference servers as CUDA IPC handles (%d slots)",
                self.slots,
            )
        else:
            reason = answer.get("reason") if isinstance(answer, dict) else "the gateway does not take them"
            log_once("gateway declined CUDA IPC (%s); inference gets host arrays", reason)
        return self.accepted

    def write(self, seq: int, tensors: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """Copy ``tensors`` into slot ``seq % slots`` and record its event: the step's
        ``meta["cuda_ipc"]``; None when they do not fit the ring (logged once)."""
        if tensors is None:
            return None
        slot = seq % self.slots
        pairs = []
        for key, dst in self.buffers[slot].items():
            src = tensors.get(key)
            if (
                src is None
                or device_of(src) != dst.device
                or src.shape != dst.shape
                or src.dtype != dst.dtype
            ):
                what = "missing" if src is None else f"{src.dtype}{list(src.shape)} on {device_of(src)}"
                log_once(
                    "observation %r does not fit the CUDA IPC ring (%s); inference gets host arrays",
                    key,
                    what,
                    level=logging.WARNING,
                )
                return None
            pairs.append((dst, src))
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
        event = self.events[slot]
        if event is None:
            self.ops.synchronize(self.index)
        else:
            self.ops.record(event[0], self.index)
        self.bytes_shared += sum(dst.numel() * dst.element_size() for dst, _ in pairs)
        return {"slot": slot, "event": None if event is None else event[1]}

    def close(self) -> None:
        """Let the buffers go once nothing queued on the stream still writes them."""
        if self.buffers:
            self.ops.synchronize(self.index)
        self.buffers, self.shared, self.events = [], [], []


class Staging:
    """Device buffers a producer copies tensors into, each shared once (weights).

    The caller may reuse (and so overwrite) the buffers only after every consumer of the
    last handle answered: consumers copy before they acknowledge.
    """

    def __init__(self, device: Any) -> None:
        why = _unusable(device)
        if why is not None:
            raise ValueError(why)
        self.ops = ops()
        self.index = self.ops.index(device)
        self.uuid: str = self.ops.uuid(self.index)
        self.buffers: dict[str, tuple[Any, list[Any]]] = {}
        self.event = self.ops.new_event(self.index)

    def handle(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """Copy ``tensors`` (on this device) into the staging buffers; their handle."""
        entries = []
        for key, src in tensors.items():
            held = self.buffers.get(key)
            if held is None or held[0].shape != src.shape or held[0].dtype != src.dtype:
                dst = self.ops.empty(tuple(src.shape), dtype_name(src), self.index)
                held = self.buffers[key] = (dst, self.ops.share(dst))
            dst, storage = held
            dst.copy_(src, non_blocking=True)
            entries.append(
                [key, dtype_name(dst), list(dst.shape), list(dst.stride()), dst.storage_offset(), storage]
            )
        for stale in set(self.buffers) - set(tensors):
            del self.buffers[stale]
        if self.event is None:
            self.ops.synchronize(self.index)
        else:
            self.ops.record(self.event[0], self.index)
        return handle_dict(self.uuid, None if self.event is None else self.event[1], entries)


# --------------------------------------------------------------------- consumer


class DeviceReader:
    """The consumer's side on one GPU: opens storages once (cached), waits on events.

    Used from a server's socket thread (observations) and its loader thread (weights);
    the caches are shared under a lock.
    """

    def __init__(self, device: Any, limits: Limits = DEFAULT_LIMITS, cache_size: int = CACHE_SIZE) -> None:
        why = _unusable(device)
        if why is not None:
            raise ValueError(why)
        self.ops = ops()
        self.index = self.ops.index(device)
        self.uuid = self.ops.uuid(self.index)
        self.host = host_identity()
        self.limits, self.cache_size = limits, cache_size
        self._storages: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._events: OrderedDict[bytes, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes_read = 0

    @classmethod
    def for_device(cls, mode: str, device: Any, limits: Limits = DEFAULT_LIMITS) -> DeviceReader | None:
        """A reader for a server whose network runs on ``device`` (``inference.cuda_ipc`` =
        ``mode``), or None: off, or not a GPU this process can share with (logged once)."""
        if mode == "off" or device is None:
            return None
        try:
            return cls(device, limits)
        except ValueError as exc:
            log_once("no CUDA IPC (%s); observations and weights come as host arrays", exc)
            return None

    def declaration(self) -> dict[str, Any]:
        """What the server announces (heartbeats, METADATA): clients compare host and uuid."""
        return {"host": self.host, "uuid": self.uuid, "device": self.index}

    def check(self, value: Any) -> DeviceHandle:
        """A handle checked for this GPU; :class:`ProtocolError` naming the problem."""
        handle = check_handle(value, self.limits)
        self.accepts(handle)
        return handle

    def accepts(self, handle: DeviceHandle) -> None:
        """:class:`ProtocolError` unless ``handle`` is from this host and for this GPU."""
        if handle.host != self.host:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "CUDA IPC handle from another host; send arrays")
        if handle.uuid != self.uuid:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"CUDA IPC handle for GPU {handle.uuid}; this server runs on {self.uuid}",
            )

    def _cached(self, cache: OrderedDict[Any, Any], key: Any, make: Any) -> Any:
        """``cache[key]``, made with ``make()`` the first time (least recently used ones go)."""
        with self._lock:
            found = cache.get(key)
            if found is not None:
                cache.move_to_end(key)
                return found
            made = cache[key] = make()
            while len(cache) > self.cache_size:
                cache.popitem(last=False)  # tensors still using it keep it open
            return made

    def _open_storage(self, a: ArrayHandle) -> Any:
        s = a.storage
        # The ref counter's slot is new at every share: a buffer freed and reallocated at
        # the same address is never taken for the old one.
        try:
            return self._cached(
                self._storages, (s[1], s[2], s[3], s[4], s[5]), lambda: self.ops.open(self.index, s)
            )
        except RuntimeError as exc:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"CUDA IPC handle of {a.key!r} cannot be opened (its producer gone?): {exc}",
            ) from None

    def _wait(self, event: bytes | None) -> None:
        if event is None:
            return  # the producer synchronised before it sent
        try:
            opened = self._cached(self._events, event, lambda: self.ops.open_event(self.index, event))
        except RuntimeError as exc:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"CUDA IPC event cannot be opened: {exc}") from None
        self.ops.wait(opened, self.index)

    def open(self, handle: DeviceHandle) -> dict[str, Any]:
        """The handle's tensors, read in place; work queued on this thread's stream after
        this waits for the producer's copy."""
        tensors = {}
        for a in handle.arrays:
            tensors[a.key] = view(self._open_storage(a), a.dtype, a.shape, a.stride, a.offset)
        self._wait(handle.event)
        self.bytes_read += handle.nbytes
        return tensors

    def copy_out(self, handle: DeviceHandle) -> dict[str, Any]:
        """Copies of the handle's tensors, complete when this returns (weights: the producer
        may overwrite its buffers once it is answered). The storages stay open: a
        publisher's staging buffers are the same from one publication to the next."""
        tensors = {k: t.clone() for k, t in self.open(handle).items()}
        self.ops.synchronize(self.index)
        return tensors
