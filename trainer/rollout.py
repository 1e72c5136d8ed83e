"""One on-policy round's rollout: every stored step of the current policy version, once.

In ``trainer.mode: sync`` the gateway stops at the round's step budget. Rank 0 then
waits until the sink has delivered every chunk the gateway cut (``unacked_chunks`` 0),
drains the rollout table (``fifo``, ``max_times_sampled: 1``: each item once, oldest
first, in requests of exactly the size the table reports, so nothing is sampled twice
or left waiting in the service), keeps the steps that acted with ``version`` and
broadcasts them to every rank::

    rollout, info = fetch_rollout(trainer, version)    # {key: tensor [N, ...]}, counts

Before that it has the gateway cut every open episode's held steps into chunks
(:func:`flush_open`, the gateway's ``flush``), each carrying the observation its env
waits in, so the rollout holds every step of the round, the last one of each env
bootstrapping on that observation. Steps of older versions are dropped and counted: the
first round's (the inference servers act with their own initial weights until the
trainer's first publication) and the first steps after a publication that a server had
not yet loaded.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gateway.protocol import RemoteError, Timeout

log = logging.getLogger(__name__)

TAKE_MAX = 65536
"""Most items one drain request asks for."""

TAKE_BYTES = 64 << 20
"""About the most bytes of observations one drain request asks for (well under a frame's limit)."""

FLUSH_WAIT_S = 5.0
"""Longest rank 0 waits for workers whose action is out before the flush is final."""

DELIVERY_WAIT_S = 30.0
"""Longest rank 0 waits for the gateway's cut chunks to reach the replay service."""

ROLLOUT_FIELDS = (
    "action",
    "reward",
    "discount",
    "terminated",
    "truncated",
    "policy_version",
    "row",
    "next_row",
)


def flush_open(control: Any, deadline_s: float = FLUSH_WAIT_S) -> dict[str, Any]:
    """Rank 0: have the gateway cut every open episode's held steps into chunks (its
    ``flush``), so the round's last steps of each env reach the rollout, each last step
    with the observation after it. Workers whose action is still out (their steps of
    this round are recorded when they answer) are waited for, at most ``deadline_s``;
    an evaluation round keeps them acting and is not waited for. Returns the last answer."""
    deadline = time.monotonic() + deadline_s
    cut = 0
    while True:
        reply = dict(control.request("flush", timeout_s=5.0))
        cut += int(reply.get("cut_steps", 0))
        if not reply.get("acting_workers") or reply.get("evaluating"):
            break
        if time.monotonic() >= deadline:
            log.warning(
                "%d worker(s) still acting after %.0f s; their last steps wait for the next round",
                reply["acting_workers"],
                deadline_s,
            )
            break
        time.sleep(0.02)
    reply["cut_steps"] = cut
    return reply


def wait_delivered(control: Any, deadline_s: float = DELIVERY_WAIT_S) -> bool:
    """Rank 0: wait until the replay service acknowledged every chunk the gateway cut."""
    deadline = time.monotonic() + deadline_s
    warned = time.monotonic()
    while True:
        try:
            status = control.request("status", timeout_s=5.0)
            if int(status.get("unacked_chunks", 0)) == 0:
                return True
        except (Timeout, RemoteError) as exc:
            log.info("waiting for the gateway's status: %s", exc)
        if time.monotonic() >= deadline:
            log.warning("chunks still unacknowledged after %.0f s; training on what is stored", deadline_s)
            return False
        if time.monotonic() - warned > 5.0:
            log.info("waiting for the gateway's chunks to reach the replay service")
            warned = time.monotonic()
        time.sleep(0.02)


def item_bytes(spec: Any) -> int:
    """Bytes one transition of ``spec`` takes in a batch (its observation twice, the action)."""
    obs = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in spec.observation.values())
    return 2 * obs + int(np.prod(spec.action.shape)) * np.dtype(spec.action.dtype).itemsize + 64


def drain(
    replay: Any, table: str, version: int, timeout_s: float, per_item: int = 1024
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Rank 0: take every item of ``table`` (``per_item`` bytes each, for the request size);
    keep those of ``version``; counts of both."""
    size = int(replay.status(timeout_s=timeout_s)["tables"][table]["size"])
    step = max(1, min(TAKE_MAX, TAKE_BYTES // max(per_item, 1)))
    parts: list[dict[str, np.ndarray]] = []
    while size > 0:
        n = min(size, step)
        parts.append(replay.take({table: n}, timeout_s=timeout_s))
        size -= n
    if not parts:
        return {}, {"taken": 0, "kept": 0, "stale": 0}
    keys = [k for k in parts[0] if k.startswith(("obs/", "next_obs/")) or k in ROLLOUT_FIELDS]
    missing = sorted(set(ROLLOUT_FIELDS) - set(parts[0]))
    if missing:
        raise ValueError(f"table {table!r} serves no {missing}: ppo's rollout table needs links: true")
    arrays = {k: np.concatenate([p[k] for p in parts]) for k in keys}
    keep = arrays["policy_version"] == version
    taken = len(keep)
    kept = {k: v[keep] for k, v in arrays.items()}
    return kept, {"taken": taken, "kept": int(keep.sum()), "stale": taken - int(keep.sum())}


def broadcast(world: Any, arrays: dict[str, np.ndarray] | None) -> dict[str, torch.Tensor]:
    """Rank 0's arrays as tensors on every rank's device (the same on all)."""
    if world.size == 1:
        assert arrays is not None
        return {k: torch.from_numpy(np.ascontiguousarray(v)).to(world.device) for k, v in arrays.items()}
    layout = [[(k, v.dtype.str, v.shape) for k, v in arrays.items()] if arrays is not None else None]
    dist.broadcast_object_list(layout, src=0)
    out: dict[str, torch.Tensor] = {}
    for key, dtype, shape in layout[0] or []:
        if arrays is not None:
            src = np.ascontiguousarray(arrays[key])
            t = torch.from_numpy(src.view(np.uint8) if src.dtype == np.bool_ else src).to(world.device)
        else:
            wire = np.dtype(np.uint8) if np.dtype(dtype) == np.bool_ else np.dtype(dtype)
            t = torch.empty(shape, dtype=torch.from_numpy(np.zeros(0, wire)).dtype, device=world.device)
        dist.broadcast(t, src=0)
        out[key] = t.bool() if np.dtype(dtype) == np.bool_ else t
    return out


def fetch_rollout(trainer: Any, version: int) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Every rank: the round's rollout of ``version`` (rank 0 drains, then broadcasts)."""
    world = trainer.world
    table = next(iter(trainer.tc.tables))
    arrays: dict[str, np.ndarray] | None = None
    info = {"taken": 0, "kept": 0, "stale": 0}
    if world.is_main:
        if trainer.control is not None:
            flush_open(trainer.control)
            wait_delivered(trainer.control)
        timeout = min(trainer.tc.sample_timeout_s, 30.0)
        arrays, info = drain(trainer.replay, table, version, timeout, item_bytes(trainer.spec))
    counts = [info["taken"], info["kept"], info["stale"]]
    if world.size > 1:
        shared = torch.tensor(counts, dtype=torch.int64, device=world.device)
        dist.broadcast(shared, src=0)
        counts = [int(x) for x in shared.tolist()]
    info = dict(zip(("taken", "kept", "stale"), counts, strict=True))
    if info["kept"] == 0:
        return {}, info
    return broadcast(world, arrays), info
