"""The in-memory replay buffer: chunks in, batches out, no sockets and no disk.

:class:`ReplayBuffer` ties the step store, the episode index and the tables together.
The replay service drives one from its loop (after the durable log accepted a chunk);
benchmarks and tests use it directly::

    buffer = ReplayBuffer(replay_config)
    buffer.insert(chunk, source="online")       # items of complete steps go to tables
    batch = buffer.sample({"online": 128, "demos": 128})   # or raises Waiting
    buffer.update_priorities(batch["key"], new_priorities)

A batch of transitions holds ``obs/<key>``, ``action``, ``reward``, ``next_obs/<key>``,
``terminated``, ``truncated``, ``discount`` (the whole bootstrap factor: ``gamma ** k``
for n-step items, ``gamma`` for transitions, 0 after termination; ``gamma`` is the
table's), ``policy_version``, ``key`` (for priority updates),
``probability`` and ``table`` (index into the tables asked for), and with the table's
``links`` ``row`` and ``next_row`` (the next step's ``row``: chains an episode's steps). Sequence items have a
time axis and every stored column: ``obs/<key>`` [B, L, ...], ``action``, ``reward``,
``success``, ``step``, ...
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from gateway.protocol import ErrorCode, Message, ProtocolError
from trainer.replay.config import ReplayConfig
from trainer.replay.storage import EpisodeIndex, Items, StepStore
from trainer.replay.table import Table

log = logging.getLogger(__name__)


TRANSITION_FIELDS = ("action", "reward", "terminated", "truncated", "policy_version")
"""Step columns a transition batch carries besides observations (``success`` and
``step`` stay in the store and in sequence batches: fewer frames per batch)."""


MAX_BATCH = 1 << 20
"""Most items one sample request may ask for."""


class Waiting(Exception):
    """A sample cannot be served now (empty table, rate limiter); the text says why."""


class ReplayBuffer:
    """Tables over one shared step store; single-threaded."""

    def __init__(self, config: ReplayConfig, *, seed: int = 0) -> None:
        self.config = config
        self.tables = {t.name: Table(t, i) for i, t in enumerate(config.tables)}
        self._by_index = list(self.tables.values())
        self.store = StepStore(config.storage_steps, self._evict, config.storage_bytes)
        self.index = EpisodeIndex(self.store, config.tables)
        self.rng = np.random.default_rng(seed)
        self.inserted_chunks = 0
        self.eval_chunks = 0
        self.refused_chunks = 0
        self.rebuilding = False
        """While True (reading the log at start), items wait and :meth:`restored` admits them."""

    def _evict(self, first_row: int) -> None:
        for table in self._by_index:
            table.evict_below(first_row)

    # ---------------------------------------------------------------- insert

    def insert(self, chunk: Message, source: str = "online") -> int:
        """Add a stored chunk's steps; return the number of items offered to tables.

        Evaluation chunks (``meta["eval"]``) are never offered to a table.
        """
        if chunk.meta.get("eval"):
            self.eval_chunks += 1
            return 0
        try:
            items = self.index.add(chunk, source)
        except ProtocolError as exc:
            # Ingest refuses such chunks; one imported or written by an older version can
            # still be in the log: it stays there (and counted), just not in a table.
            self.refused_chunks += 1
            if self.refused_chunks <= 10:
                log.error("chunk %s kept out of the tables: %s", chunk.meta.get("chunk_id"), exc)
            return 0
        self.inserted_chunks += 1
        offered = self._offer(items)
        if not self.rebuilding:
            self.admit()
        return offered

    def _offer(self, items: dict[str, Items]) -> int:
        offered = 0
        for name, part in items.items():
            self.tables[name].offer(part)
            offered += len(part)
        return offered

    def settle(self, now: float) -> int:
        """Start online episodes whose step 0 did not come in time (see
        :meth:`EpisodeIndex.settle`); return the items offered."""
        offered = self._offer(self.index.settle(now))
        if offered:
            self.admit()
        return offered

    def admit(self) -> int:
        return sum(t.admit(self.store.first) for t in self._by_index)

    def release_rate_limits(self) -> int:
        """Lift every table's samples-per-insert limit and admit what waits; return items admitted.

        For the end of training: nothing samples any more, and collection (evaluation
        episodes, for one) must not wait for a ratio no one keeps."""
        for table in self._by_index:
            table.limiter.release()
        return self.admit()

    def pending(self) -> int:
        """Most items waiting for any one table's rate limiter."""
        return max((t.pending_items for t in self._by_index), default=0)

    def overloaded(self) -> bool:
        """Whether some table holds more waiting items than its ``max_pending``."""
        return any(t.pending_items > t.config.max_pending for t in self._by_index)

    def restored(self) -> None:
        """After rebuilding from the log: admit everything, rate limiters balanced."""
        self.rebuilding = False
        for table in self._by_index:
            spi, table.limiter.spi = table.limiter.spi, None  # let everything in
            try:
                table.admit(self.store.first)
            finally:
                table.limiter.spi = spi
            table.limiter.restored(table.limiter.inserts)

    # ---------------------------------------------------------------- sample

    def check_request(self, counts: dict[str, int]) -> None:
        if not counts:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "sample: name at least one table")
        for name, n in counts.items():
            if name not in self.tables:
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST,
                    f"sample: no table {name!r}; tables: {', '.join(self.tables)}",
                )
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"sample: count for {name!r} must be an int >= 0")
        total = sum(counts.values())
        if not 0 < total <= MAX_BATCH:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"sample: batch size must be 1..{MAX_BATCH}, got {total}"
            )
        kinds = {(self.tables[n].config.item, self.tables[n].width) for n, k in counts.items() if k}
        if len(kinds) > 1:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"sample: tables hold different items (kind, length) {sorted(kinds)}: one batch needs one shape",
            )

    def ready(self, counts: dict[str, int]) -> str | None:
        """None when every table can serve its count now, else why not."""
        for name, n in counts.items():
            table = self.tables[name]
            if n and not table.can_sample(n):
                return table.why_not(n)
        return None

    def sample(self, counts: dict[str, int]) -> dict[str, np.ndarray]:
        """One batch drawn from several tables at once (all or nothing)."""
        self.check_request(counts)
        reason = self.ready(counts)
        if reason is not None:
            for name, n in counts.items():
                if n and not self.tables[name].can_sample(n):
                    self.tables[name].limiter.blocked_samples += 1
            raise Waiting(reason)
        parts = []
        for position, (name, n) in enumerate(counts.items()):
            if not n:
                continue
            table = self.tables[name]
            slots, prob = table.sample(n, self.rng)
            part = self.gather(table, slots)
            part["key"] = table.keys[slots]
            part["probability"] = prob
            part["table"] = np.full(n, position, np.uint8)
            table.sampled(slots)
            parts.append(part)
        if len(parts) == 1:
            return parts[0]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def gather(self, table: Table, slots: np.ndarray) -> dict[str, np.ndarray]:
        """Copy the items in ``slots`` out of the store."""
        store = self.store
        cfg = table.config
        out: dict[str, np.ndarray] = {}
        obs_keys = [k for k in store.columns if k.startswith("obs/")]
        if cfg.item == "sequence":
            at = store.locate(table.rows[slots])
            for key in store.columns:
                out[key] = store.take_at(key, at)
            return out
        if cfg.item == "transition":
            at = store.locate(table.rows[slots, 0])
            at_boot = store.locate(table.boot[slots])
            for key in TRANSITION_FIELDS:
                out[key] = store.take_at(key, at)
            for key in obs_keys:
                out[key] = store.take_at(key, at)
            for key in obs_keys:
                out["next_" + key] = store.take_at(key, at_boot)
            out["discount"] = np.where(out["terminated"], 0.0, cfg.gamma).astype(np.float32)
            if cfg.links:
                out["row"] = table.rows[slots, 0].copy()
                out["next_row"] = table.boot[slots].copy()
            return out
        rows = table.rows[slots]  # [B, n], -1 beyond the end of the episode
        valid = rows >= 0
        first = rows[:, 0]
        for key in ("action", "policy_version", *obs_keys):
            out[key] = store.take(key, first)
        reward = np.where(valid, store.take("reward", np.where(valid, rows, 0)), 0.0)
        powers = cfg.gamma ** np.arange(rows.shape[1])
        out["reward"] = (reward * powers).sum(axis=1).astype(np.float32)
        last = np.where(valid, rows, 0)[np.arange(len(rows)), valid.sum(axis=1) - 1]
        out["terminated"] = store.take("terminated", last)
        out["truncated"] = store.take("truncated", last)
        k = valid.sum(axis=1)
        out["discount"] = np.where(out["terminated"], 0.0, cfg.gamma**k).astype(np.float32)
        boot = table.boot[slots]
        for key in obs_keys:
            out["next_" + key] = store.take(key, boot)
        return out

    def update_priorities(self, keys: np.ndarray, priorities: np.ndarray) -> int:
        """Route ``(key, priority)`` pairs to their tables; return how many were applied."""
        keys = np.asarray(keys, np.int64)
        priorities = np.asarray(priorities, np.float64)
        if keys.shape != priorities.shape or keys.ndim != 1:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"update_priorities: keys {list(keys.shape)} and priorities {list(priorities.shape)} "
                f"must be equal-length vectors",
            )
        if not np.all(np.isfinite(priorities)) or np.any(priorities < 0):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, "update_priorities: priorities must be finite and >= 0"
            )
        which = keys >> 56
        applied = 0
        for index in np.unique(which):
            if not 0 <= index < len(self._by_index):
                continue
            mask = which == index
            applied += self._by_index[int(index)].update_priorities(keys[mask], priorities[mask])
        return applied

    def state(self) -> dict[str, Any]:
        return {
            "tables": {name: t.state() for name, t in self.tables.items()},
            "stored_rows": len(self.store),
            "storage_steps": self.store.capacity,
            "open_episodes": len(self.index.episodes),
            "late_chunks": self.index.late_chunks,
            "eval_chunks": self.eval_chunks,
            "refused_chunks": self.refused_chunks,
        }
