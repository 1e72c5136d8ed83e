"""Episode data stored once, and the items tables build on it.

:class:`StepStore` holds every step the tables can refer to in column arrays
(``obs/<key>``, ``action``, ``reward``, ...) used as a ring: row ``g`` (a global,
ever-growing row number) lives at ``g % capacity``; when the ring wraps, the oldest rows
go and tables drop the items that refer to them (``on_evict``). An episode's last
observation (``final_obs``) gets a row of its own.

:class:`EpisodeIndex` takes chunks in arrival order, appends their steps to the store and
turns them into items for the tables fed by the chunk's source (``interventions``
tables take the items of online chunks whose first step is flagged ``intervention``,
besides the ``online`` tables that take every item). An item is a few row
numbers (``rows``: one for a transition, up to ``n`` for an n-step item, ``L`` for a
sequence) and ``boot``, the row of the observation after it. A chunk's last step becomes
an item only once the next observation is known: from the episode's next chunk or from
its ``final_obs``; the last step of an interrupted episode has none and never becomes a
transition. Chunks that arrive ahead of a gap in their episode wait for the gap; an online
episode starts at step 0, and its later chunks wait for it up to ``START_WAIT_S``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from gateway.protocol import ErrorCode, Message, ProtocolError, unpack
from gateway.trajectory import with_added_fields
from trainer.replay.config import TableConfig

log = logging.getLogger(__name__)

STORED_FIELDS: dict[str, str] = {
    "reward": "float32",
    "terminated": "bool",
    "truncated": "bool",
    "success": "bool",
    "policy_version": "int64",
    "step": "int64",
    "intervention": "bool",
}
"""Per-step scalars kept besides ``obs/*`` and ``action``."""

Rows = npt.NDArray[np.int64]


class StepStore:
    """Column arrays of steps, used as a ring of ``capacity`` rows."""

    def __init__(self, capacity: int, on_evict: Callable[[int], None], max_bytes: int | None = None) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.on_evict = on_evict
        self.columns: dict[str, np.ndarray] = {}
        self.first = 0
        """Oldest row number still held."""
        self.next = 0
        """Row number the next appended row gets."""

    def layout(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {k: (v.dtype.name, v.shape[1:]) for k, v in self.columns.items()}

    def _allocate(self, arrays: dict[str, np.ndarray]) -> None:
        row_bytes = sum(arr[0].nbytes for arr in arrays.values())
        if self.max_bytes is not None and row_bytes * self.capacity > self.max_bytes:
            self.capacity = max(1024, self.max_bytes // max(row_bytes, 1))
            log.info("step store: %d rows of %d bytes fit storage_bytes", self.capacity, row_bytes)
        for key, arr in arrays.items():
            self.columns[key] = np.zeros((self.capacity, *arr.shape[1:]), arr.dtype)

    def check_layout(self, arrays: dict[str, np.ndarray], what: str) -> None:
        if not self.columns:
            return
        want = {k: v for k, v in self.layout().items()}
        got = {k: (v.dtype.name, v.shape[1:]) for k, v in arrays.items()}
        if want != got:
            diff = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
            detail = "; ".join(f"{k}: stored {want.get(k)}, got {got.get(k)}" for k in diff)
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"{what}: arrays differ from the steps already stored ({detail})"
            )

    def append(self, arrays: dict[str, np.ndarray]) -> int:
        """Write rows (every column has the same length); return the first row number."""
        n = len(next(iter(arrays.values())))
        if not self.columns:
            self._allocate(arrays)
        if n > self.capacity:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"{n} steps do not fit a store of {self.capacity}")
        if self.next + n - self.first > self.capacity:
            # Free a block at once so eviction (a scan over the tables) stays rare.
            new_first = self.next + n - self.capacity + max(1, self.capacity // 16)
            self.on_evict(new_first)
            self.first = new_first
        g0 = self.next
        pos = g0 % self.capacity
        first_part = min(n, self.capacity - pos)
        for key, col in self.columns.items():
            src = arrays[key]
            col[pos : pos + first_part] = src[:first_part]
            if first_part < n:
                col[: n - first_part] = src[first_part:]
        self.next += n
        return g0

    def locate(self, rows: np.ndarray) -> np.ndarray:
        """Positions in the ring of global ``rows``, for :meth:`take_at` on several columns."""
        at: np.ndarray = rows % self.capacity
        return at

    def take_at(self, key: str, at: np.ndarray) -> np.ndarray:
        # ndarray.take gathers rows about twice as fast as fancy indexing.
        out: np.ndarray = self.columns[key].take(at, axis=0)
        return out

    def take(self, key: str, rows: np.ndarray) -> np.ndarray:
        return self.take_at(key, self.locate(rows))

    def __len__(self) -> int:
        return self.next - self.first


@dataclass
class Items:
    """New items for one table: ``rows`` [k, L] (padded with -1) and ``boot`` [k]."""

    rows: Rows
    boot: Rows

    def __len__(self) -> int:
        return len(self.boot)


START_WAIT_S = 60.0
"""Longest an online episode's later chunks wait for its step 0 before the episode starts
at the first of them (a sink resends a refused or lost chunk within seconds)."""


@dataclass
class OpenEpisode:
    rows: list[int] = field(default_factory=list)
    next_step: int = 0
    end: str | None = None
    final_row: int | None = None
    boot_row: int | None = None
    """Row of the ``boot_obs`` the latest chunk brought (cut before the episode's end by a
    flush): its last step's next observation, until the next chunk comes."""
    last_terminated: bool = False
    done: dict[str, int] = field(default_factory=dict)
    held: dict[int, Message] = field(default_factory=dict)
    since: float = 0.0
    """When its first chunk arrived (``time.monotonic``)."""


Layout = dict[str, tuple[str, tuple[int, ...]]]


def check_arrays(chunk: Message, layout: Layout | None) -> Layout:
    """Refuse (``bad_request``) a chunk the step store could not take; return its layout.

    ``final_obs/*`` must match ``obs/*`` key for key (one row), and every stored column
    must have the dtype and per-step shape of the chunks stored before (``layout``).
    """
    cid = chunk.meta.get("chunk_id")
    obs = unpack("obs", chunk.arrays)
    final = unpack("final_obs", chunk.arrays)
    boot = unpack("boot_obs", chunk.arrays)
    if boot and (final or chunk.meta.get("end")):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"trajectory chunk {cid}: boot_obs/* is for chunks cut before their episode's end",
        )
    final = final or boot
    if final:
        for key, arr in obs.items():
            got = final.get(key)
            if got is None or got.shape != (1, *arr.shape[1:]) or got.dtype != arr.dtype:
                have = "missing" if got is None else f"{got.dtype}{list(got.shape)}"
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST,
                    f"trajectory chunk {cid}: final_obs/{key} is {have}, expected {arr.dtype}{[1, *arr.shape[1:]]}",
                )
        extra = sorted(set(final) - set(obs))
        if extra:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"trajectory chunk {cid}: final_obs/{extra[0]} has no obs/{extra[0]}"
            )
    mine = {k: (v.dtype.name, tuple(v.shape[1:])) for k, v in step_arrays(chunk).items()}
    if layout is not None and mine != layout:
        diff = sorted(k for k in set(mine) | set(layout) if mine.get(k) != layout.get(k))
        detail = "; ".join(f"{k}: stored {layout.get(k)}, got {mine.get(k)}" for k in diff)
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"trajectory chunk {cid}: arrays differ from the steps already stored ({detail})",
        )
    return mine


def step_arrays(chunk: Message) -> dict[str, np.ndarray]:
    """The columns a chunk contributes to the store, one row per step."""
    arrays: dict[str, np.ndarray] = {f"obs/{k}": v for k, v in unpack("obs", chunk.arrays).items()}
    arrays["action"] = chunk.arrays["action"]
    with_added_fields(chunk)  # a chunk logged by an older version has no intervention flags
    for key in STORED_FIELDS:
        arrays[key] = chunk.arrays[key]
    return arrays


class EpisodeIndex:
    """Chunks in, items out: the per-episode bookkeeping between the store and tables."""

    def __init__(self, store: StepStore, tables: list[TableConfig]) -> None:
        self.store = store
        self.tables = tables
        self.episodes: dict[str, OpenEpisode] = {}
        self.late_chunks = 0

    def add(self, chunk: Message, source: str) -> dict[str, Items]:
        """Store a chunk's steps and return the items that became complete, by table."""
        out: dict[str, list[Items]] = {}
        self._add(chunk, source, out)
        return self._merged(out)

    def settle(self, now: float) -> dict[str, Items]:
        """Start the online episodes whose step 0 has not come within
        :data:`START_WAIT_S` at their first chunk here, and return the items that became
        complete, by table.

        Their first steps were never acknowledged (a gateway killed before it spooled
        them) or retention retired them from the log; waiting longer would keep the
        rest of the episode out of the tables for good."""
        out: dict[str, list[Items]] = {}
        started = 0
        for ep in list(self.episodes.values()):
            if ep.rows or not ep.held or now - ep.since < START_WAIT_S:
                continue
            ep.next_step = min(ep.held)
            chunk = ep.held.pop(ep.next_step)
            self._add(chunk, chunk.meta.get("source", "online"), out)
            started += 1
        if started:
            log.info("%d episode(s) whose step 0 never came start at their first stored step", started)
        return self._merged(out)

    @staticmethod
    def _merged(out: dict[str, list[Items]]) -> dict[str, Items]:
        merged = {}
        for name, parts in out.items():
            parts = [p for p in parts if len(p)]
            if parts:
                width = max(p.rows.shape[1] for p in parts)
                rows = np.concatenate([_pad(p.rows, width) for p in parts])
                merged[name] = Items(rows, np.concatenate([p.boot for p in parts]))
        return merged

    def _add(self, chunk: Message, source: str, out: dict[str, list[Items]]) -> None:
        meta = chunk.meta
        episode_id, first = meta["episode_id"], int(meta["first_step"])
        ep = self.episodes.get(episode_id)
        if ep is None:
            # An online episode starts at step 0, whichever of its chunks arrives first (a
            # resend after a reconnect can bring chunk 1 before chunk 0); ahead of it, a
            # chunk waits for step 0 up to START_WAIT_S (settle). A demonstration starts
            # where its take began.
            start = 0 if source == "online" else first
            ep = self.episodes[episode_id] = OpenEpisode(next_step=start, since=time.monotonic())
        if first < ep.next_step:
            self.late_chunks += 1
            log.debug(
                "chunk %s arrived after later steps of its episode; kept in the log only", meta["chunk_id"]
            )
            return
        if first > ep.next_step:
            ep.held[first] = chunk  # wait for the gap to fill
            return
        arrays = step_arrays(chunk)
        final = unpack("final_obs", chunk.arrays)
        boot = unpack("boot_obs", chunk.arrays) if not meta.get("end") else {}
        self.store.check_layout(arrays, f"chunk {meta['chunk_id']}")
        if final or boot:
            arrays = _with_final_row(arrays, final or boot)
        g0 = self.store.append(arrays)
        n = int(meta["num_steps"])
        ep.rows.extend(range(g0, g0 + n))
        ep.next_step += n
        ep.boot_row = g0 + n if boot else None
        if meta.get("end"):
            ep.end = meta["end"]
            ep.final_row = g0 + n if final else None
            ep.last_terminated = bool(chunk.arrays["terminated"][-1])
        for table in self.tables:
            if table.source == source:
                out.setdefault(table.name, []).append(self._emit(ep, table))
            elif table.source == "interventions" and source == "online":
                out.setdefault(table.name, []).append(self._interventions(self._emit(ep, table)))
        nxt = ep.held.pop(ep.next_step, None)
        if ep.end is not None:
            del self.episodes[episode_id]
        elif nxt is not None:
            self._add(nxt, source, out)

    def _interventions(self, items: Items) -> Items:
        """The items whose first step's action was an intervention (a takeover's)."""
        if not len(items):
            return items
        keep = self.store.take("intervention", items.rows[:, 0])
        return Items(items.rows[keep], items.boot[keep])

    def _next_obs_row(self, ep: OpenEpisode, j: int) -> int | None:
        if j + 1 < len(ep.rows):
            return ep.rows[j + 1]
        if ep.end is None:
            return None
        if ep.final_row is not None:
            return ep.final_row
        return ep.rows[j] if ep.last_terminated else None  # terminated: masked by the flag

    def _emit(self, ep: OpenEpisode, table: TableConfig) -> Items:
        start = ep.done.get(table.name, 0)
        total = len(ep.rows)
        ended = ep.end is not None
        if table.item == "transition":
            rows = np.asarray(ep.rows[start:total], np.int64)
            tail = self._next_obs_row(ep, total - 1) if ended and total else None
            if not ended and ep.boot_row is not None and start < total:
                tail = ep.boot_row  # a flushed chunk: its last step bootstraps on boot_obs
            if tail is None:
                items, boot = rows[:-1], rows[1:]
            else:
                items, boot = rows, np.append(rows[1:], tail)
            ep.done[table.name] = total if ended or tail is not None else max(start, total - 1)
            return Items(items.reshape(-1, 1), boot.astype(np.int64))
        rows_out: list[list[int]] = []
        boots: list[int] = []
        j = start
        if table.item == "nstep":
            n = table.n_step
            tail = self._next_obs_row(ep, total - 1) if ended and total else None
            limit = total if tail is not None else total - 1  # steps whose next observation is known
            while j < total:
                if not ended:
                    if j + n >= total:
                        break
                    e = j + n
                else:
                    e = min(j + n, limit)
                    if e <= j:
                        break
                rows_out.append(ep.rows[j:e])
                boots.append(ep.rows[e] if e < total else tail)  # type: ignore[arg-type]
                j += 1
            if ended:
                j = total
            width = n
        else:
            length, stride = table.sequence_length, table.sequence_stride
            while j + length <= total:
                rows_out.append(ep.rows[j : j + length])
                boots.append(-1)
                j += stride
            if ended:
                j = total
            width = length
        ep.done[table.name] = j
        rows_arr = np.full((len(rows_out), width), -1, np.int64)
        for i, window in enumerate(rows_out):
            rows_arr[i, : len(window)] = window
        return Items(rows_arr, np.asarray(boots, np.int64))


def _pad(rows: Rows, width: int) -> Rows:
    if rows.shape[1] == width:
        return rows
    out = np.full((len(rows), width), -1, np.int64)
    out[:, : rows.shape[1]] = rows
    return out


def _with_final_row(arrays: dict[str, np.ndarray], final: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Append one row holding the final observation (other columns zero)."""
    out: dict[str, Any] = {}
    for key, arr in arrays.items():
        extra = np.zeros((1, *arr.shape[1:]), arr.dtype)
        if key.startswith("obs/"):
            name = key[4:]
            if name not in final or final[name].shape[1:] != arr.shape[1:]:
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST, f"final_obs/{name} is missing or does not match obs/{name}"
                )
            extra = final[name].astype(arr.dtype, copy=False)
        out[key] = np.concatenate([arr, extra])
    return out
