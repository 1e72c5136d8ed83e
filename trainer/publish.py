"""Weight publication: the trainer's newest policy to every inference server.

Every ``publish_every`` updates all ranks gather the actor's full state dict onto rank 0
(DCP's ``get_model_state_dict(full_state_dict=True, cpu_offload=True)``: one
all-gather, the only part that holds training up; a group of one reads its shards, which
are whole, directly); rank 0 checks every value is finite
and hands the arrays to a background thread, which sends them as bucketed WEIGHTS
messages (an ONNX export instead when an onnxruntime backend serves) and tells the gateway
the trainer's version, for policy-lag accounting. A publication still in flight when
the next one is due is superseded by the newer one, never queued behind it.

Non-finite weights are never published: the publication is refused, counted and logged.

On one GPU (one trainer process on CUDA, torch inference servers, ``inference.cuda_ipc``
not ``off``), snapshots stay on the device (``cpu_offload=False``) and servers that declare
the same GPU get them as a CUDA IPC handle, copied device to device
(:mod:`inference.weights`); the others get host buckets of the same version.

Each version is written to ``record`` (``<run>/checkpoints/published_version``) when it
is made, before anyone hears of it (a superseded one too), so a trainer restarted from an
older checkpoint continues after it even when the gateway and the inference servers were
restarted too and know no version (:func:`trainer.versions.last_published`); a version
number never names two different sets of weights.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from gateway.episode import EnvSpec
from gateway.protocol import RemoteError, Timeout
from trainer.versions import record_published

log = logging.getLogger(__name__)


def full_state_dict(
    module: nn.Module, out: Mapping[str, Any] | None = None, *, device: bool = False
) -> dict[str, Any]:
    """A snapshot of the module's full (unsharded) state dict as numpy arrays (``device``:
    as float32 tensors on the module's device); every rank must call it. Always a copy:
    with one process the gathered tensors can be the live parameters themselves, which
    the next optimizer step would change under a sender. ``out``: an earlier snapshot no
    longer in use, overwritten instead of allocating (a fresh 400 MB allocation costs
    more in page faults than the copy itself)."""
    state = _whole_local_state(module)
    if state is None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=not device)
        state = get_model_state_dict(module, options=options)
    if device:
        return _device_snapshot(state, out)
    arrays: dict[str, np.ndarray] = {}
    for k, v in state.items():
        src = v.detach().to(torch.float32 if v.is_floating_point() else v.dtype).numpy()
        dst = out.get(k) if out is not None else None
        if dst is not None and dst.shape == src.shape and dst.dtype == src.dtype:
            np.copyto(dst, src)
            arrays[k] = dst
        else:
            arrays[k] = np.array(src, copy=True)
    return arrays


_LOCAL_IS_WHOLE: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
"""Per module: whether its own ``state_dict()`` names the same tensors as DCP's full state dict."""


def _whole_local_state(module: nn.Module) -> dict[str, torch.Tensor] | None:
    """In a group of one, every shard is the whole tensor, so the module's own state dict
    (each DTensor's local tensor) is the full state dict without DCP's gather machinery,
    which costs several times the copy it feeds (0.5-1 ms for a 1M-parameter actor). The
    first call for a module checks that both name the same tensors (a compiled or wrapped
    module's own names differ) and answers ``None`` then, as it does in a larger group:
    the caller gathers through DCP."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return None
    known = _LOCAL_IS_WHOLE.get(module)
    if known is False:
        return None
    state: dict[str, torch.Tensor] = {}
    for k, v in module.state_dict().items():
        local = v.to_local() if isinstance(v, DTensor) else v
        if local.shape != v.shape:
            _LOCAL_IS_WHOLE[module] = False
            return None
        state[k] = local
    if known is None:
        full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
        _LOCAL_IS_WHOLE[module] = same = full.keys() == state.keys() and all(
            full[k].shape == state[k].shape for k in full
        )
        if not same:
            return None
    return state


def _device_snapshot(
    state: Mapping[str, torch.Tensor], out: Mapping[str, Any] | None
) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        src = v.detach().to(torch.float32 if v.is_floating_point() else v.dtype)
        dst = out.get(k) if out is not None else None
        if isinstance(dst, torch.Tensor) and (dst.shape, dst.dtype, dst.device) == (
            src.shape,
            src.dtype,
            src.device,
        ):
            dst.copy_(src)
            tensors[k] = dst
        else:
            tensors[k] = src.clone()
    return tensors


def non_finite(arrays: Mapping[str, Any]) -> list[str]:
    """Names of float arrays (numpy, or tensors on any device) holding NaN or Inf."""
    bad = []
    for k, v in arrays.items():
        if isinstance(v, np.ndarray):
            if v.dtype.kind == "f" and not np.isfinite(v).all():
                bad.append(k)
        elif v.is_floating_point() and not bool(torch.isfinite(v).all()):
            bad.append(k)
    return bad


class Publisher:
    """Rank 0's publication thread; other ranks only take part in the gather."""

    def __init__(
        self,
        *,
        spec: EnvSpec,
        net_config: Any,
        targets: Sequence[Mapping[str, Any] | str],
        onnx: bool,
        control: Any | None,
        timeout_s: float = 30.0,
        record: Path | None = None,
        device: bool = False,
    ) -> None:
        from inference.weights import WeightsPublisher

        self.spec, self.net_config, self.onnx = spec, net_config, onnx
        self.device = device
        """Snapshots stay on the trainer's GPU (CUDA IPC to servers on it, host buckets to others)."""
        self.record = record
        self.control = control
        self.publisher = WeightsPublisher(targets, timeout_s=timeout_s) if targets else None
        self.request_timeout_s = 5.0
        """Longest wait for the gateway's answer to a new version (see :meth:`shorten_waits`)."""
        self.published_version = 0
        self.refused = 0
        self.failures = 0
        self.history: list[tuple[int, float]] = []
        self._queue: queue.Queue[tuple[int, dict[str, Any], float] | None] = queue.Queue(maxsize=1)
        self._spare: list[dict[str, Any]] = []
        """Snapshots that no socket holds any more, reused by :meth:`snapshot`."""
        self._spare_lock = threading.Lock()
        self._targets: Sequence[Mapping[str, Any] | str] | None = None
        """New server addresses (:meth:`retarget`), applied by the sending thread."""
        self._thread = threading.Thread(target=self._run, name="publisher", daemon=True)
        self._thread.start()

    def shorten_waits(self, timeout_s: float) -> None:
        """A signal stops the trainer: the gateway and the inference servers may be gone
        too, and a publication in flight must not keep the rank alive past torchrun's
        shutdown limit. Waits for their answers, the one in progress included, end
        ``timeout_s`` after they began at most."""
        self.request_timeout_s = min(self.request_timeout_s, timeout_s)
        if self.publisher is not None:
            self.publisher.timeout_s = min(self.publisher.timeout_s, timeout_s)

    def snapshot(self, module: nn.Module) -> dict[str, Any]:
        """:func:`full_state_dict` into the buffers of a finished publication when there is one."""
        with self._spare_lock:
            out = self._spare.pop() if self._spare else None
        return full_state_dict(module, out, device=self.device)

    def _recycle(self, arrays: dict[str, Any]) -> None:
        with self._spare_lock:
            if len(self._spare) < 2:
                self._spare.append(arrays)

    def submit(self, version: int, arrays: dict[str, Any]) -> None:
        """Queue a snapshot as ``version``, replacing a queued older one. The sending thread
        refuses it (``refused``) if any value is NaN or Inf: the check reads every weight,
        so it stays off the training loop too.

        The number is recorded first, here: the thread may still be waiting on a server
        gone silent, and a trainer killed meanwhile must continue after every number it
        made (its metrics name them), not only after those the thread took."""
        if self.record is not None:
            record_published(self.record, version)
        with contextlib.suppress(queue.Empty):
            superseded = self._queue.get_nowait()  # superseded before it was sent
            if superseded is not None:
                self._recycle(superseded[1])
        self._queue.put((version, arrays, time.time()))

    def retarget(self, targets: Sequence[Mapping[str, Any] | str]) -> None:
        """The servers' addresses changed (``endpoints.json``: one restarted on another
        node); the next publication goes to the new ones."""
        with self._spare_lock:
            self._targets = targets

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            with self._spare_lock:
                targets, self._targets = self._targets, None
            if targets is not None and self.publisher is not None:
                self.publisher.follow(targets)
            version, arrays, created = item
            started = time.monotonic()
            bad = non_finite(arrays)
            if bad:
                self.refused += 1
                log.error("version %d not published: non-finite values in %s", version, ", ".join(bad[:5]))
                self._recycle(arrays)
                continue
            try:
                if self.control is not None:
                    # The gateway measures policy lag against when a version was made,
                    # not when it reached the servers.
                    self.control.request(
                        "trainer_version", timeout_s=self.request_timeout_s, version=version, t=created
                    )
                if self.publisher is not None:
                    # onnxruntime servers get the ONNX export of this version, others the tensors.
                    if self.onnx:
                        blob = self._export(arrays)
                        self._recycle(arrays)
                        results = self.publisher.publish_onnx(blob, version, check=False)
                    else:
                        results = self.publisher.publish(arrays, version, check=False)
                        if all(r.get("ok") for r in results):
                            # Every server has every bucket: no socket still holds these
                            # arrays. (An error may answer before the last bucket left.)
                            self._recycle(arrays)
                    failed = [r for r in results if not r.get("ok")]
                    for r in failed:
                        log.warning(
                            "publication of version %d refused by %s: [%s] %s",
                            version,
                            r["address"],
                            r.get("code"),
                            r.get("message"),
                        )
                    self.failures += bool(failed)
                self.published_version = version
                self.history.append((version, time.time()))
                log.debug("published version %d in %.1f ms", version, (time.monotonic() - started) * 1e3)
            except (Timeout, RemoteError) as exc:
                # A server that misses this publication catches up with the next one.
                self.failures += 1
                log.warning("publication of version %d incomplete: %s", version, exc)

    def _export(self, arrays: dict[str, Any]) -> bytes:
        from inference.weights import host_arrays
        from networks.modules import export_onnx, load_numpy, make_actor

        actor = make_actor(self.spec, self.net_config)
        load_numpy(actor, host_arrays(arrays))
        return export_onnx(actor)

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until the queued publication has been handed over."""
        deadline = time.monotonic() + timeout_s
        while not self._queue.empty() and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)
        if self.publisher is not None:
            self.publisher.close()


class LaggedControl:
    """The publisher's line to the gateway: each new version, with the lag bound of async mode."""

    def __init__(self, address: str, tc: Any) -> None:
        from gateway.control_client import ControlClient

        self.client = ControlClient(address)
        self.max_lag = tc.max_policy_lag if tc.mode != "sync" else None

    def request(self, cmd: str, timeout_s: float = 5.0, **meta: Any) -> dict[str, Any]:
        return self.client.request(cmd, timeout_s=timeout_s, max_policy_lag=self.max_lag, **meta)
