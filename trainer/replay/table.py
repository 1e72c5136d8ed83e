"""A replay table: items in slots, a sampler, a FIFO remover and a rate limiter.

Items refer to rows of the shared :class:`~trainer.replay.storage.StepStore` (the
episode data is stored once; several tables may refer to the same steps). New items
wait in ``pending`` until the rate limiter lets them in::

    table = Table(config, index=0)
    table.offer(items)                 # complete items from the episode index
    table.admit(store.first)           # as many as the rate limiter allows
    if table.can_sample(256):
        slots, probability = table.sample(256, rng)
        keys = table.keys[slots]       # what the trainer sends back with new priorities
        table.sampled(slots)           # counts; removes items at max_times_sampled
    table.update_priorities(keys, priorities)

An item's key is ``table index << 56 | generation << 32 | slot``: a key whose slot was
reused by a newer item no longer matches and its priority update is ignored.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import numpy as np
import numpy.typing as npt

from trainer.replay.config import TableConfig
from trainer.replay.rate_limiter import RateLimiter
from trainer.replay.samplers import KeyQueue, PrioritizedSampler, QueueSampler, UniformSampler
from trainer.replay.storage import Items

log = logging.getLogger(__name__)

SLOT_MASK = (1 << 32) - 1
GEN_MASK = (1 << 24) - 1


class Table:
    """One named table; single-threaded (the replay service's loop owns it)."""

    def __init__(self, config: TableConfig, index: int) -> None:
        self.config = config
        self.name = config.name
        self.index = index
        cap = config.max_size
        self.width = (
            1
            if config.item == "transition"
            else (config.n_step if config.item == "nstep" else config.sequence_length)
        )
        self.rows = np.full((cap, self.width), -1, np.int64)
        self.boot = np.full(cap, -1, np.int64)
        self.keys = np.full(cap, -1, np.int64)
        self.times = np.zeros(cap, np.int64)
        self._gen = np.zeros(cap, np.int64)
        self._free = np.arange(cap - 1, -1, -1, dtype=np.int64)  # a stack: low slots first
        self._nfree = cap
        self.order = KeyQueue(cap, self._live)
        self.sampler: UniformSampler
        if config.sampler == "prioritized":
            self.sampler = PrioritizedSampler(cap, config.priority_exponent, config.initial_priority)
        elif config.sampler in ("fifo", "lifo"):
            self.sampler = QueueSampler(cap, self.order, config.sampler == "lifo", self.slot_of)
        else:
            self.sampler = UniformSampler(cap)
        self.limiter = RateLimiter(
            min_size_to_sample=config.min_size_to_sample,
            samples_per_insert=config.samples_per_insert,
            error_buffer=config.error_buffer,
        )
        self.pending: deque[Items] = deque()
        self.pending_items = 0
        self.removed = 0
        self.evicted = 0

    # ------------------------------------------------------------------ keys

    def slot_of(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        return np.asarray(keys, np.int64) & SLOT_MASK

    def _live(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
        slots = self.slot_of(keys)
        ok = slots < len(self.keys)
        ok[ok] = self.keys[slots[ok]] == keys[ok]
        return ok

    @property
    def size(self) -> int:
        return len(self.keys) - self._nfree

    # ---------------------------------------------------------------- insert

    def offer(self, items: Items) -> None:
        """Queue complete items; :meth:`admit` moves them in as the rate limiter allows."""
        if len(items):
            self.pending.append(items)
            self.pending_items += len(items)

    def admit(self, first_row: int) -> int:
        """Insert pending items the rate limiter lets through; return how many."""
        admitted = 0
        while self.pending:
            allowed = self.limiter.insertable(self.pending_items)
            if allowed <= 0:
                self.limiter.blocked_inserts += 1
                break
            head = self.pending[0]
            take = min(allowed, len(head))
            if take == len(head):
                self.pending.popleft()
                part = head
            else:
                part = Items(head.rows[:take], head.boot[:take])
                self.pending[0] = Items(head.rows[take:], head.boot[take:])
            self.pending_items -= take
            # Steps the store dropped meanwhile cannot be sampled any more.
            alive = part.rows[:, 0] >= first_row
            if not alive.all():
                part = Items(part.rows[alive], part.boot[alive])
            self._insert(part)
            self.limiter.inserted(take)
            admitted += take
        return admitted

    def _insert(self, items: Items) -> None:
        k = len(items)
        if k == 0:
            return
        if k > len(self.keys):
            items = Items(items.rows[-len(self.keys) :], items.boot[-len(self.keys) :])
            k = len(items)
        over = self.size + k - len(self.keys)
        if over > 0:  # the FIFO remover makes room
            self.remove(self.slot_of(self.order.oldest(over)))
        slots = self._free[self._nfree - k : self._nfree][::-1].copy()
        self._nfree -= k
        self.rows[slots] = items.rows
        self.boot[slots] = items.boot
        self.times[slots] = 0
        self._gen[slots] = (self._gen[slots] + 1) & GEN_MASK
        keys = (self.index << 56) | (self._gen[slots] << 32) | slots
        self.keys[slots] = keys
        self.sampler.add(slots)
        self.order.push(keys, self.size)

    def remove(self, slots: npt.NDArray[np.int64]) -> None:
        slots = np.unique(slots)
        slots = slots[self.keys[slots] >= 0]
        if not len(slots):
            return
        self.sampler.remove(slots)
        self.keys[slots] = -1
        self._free[self._nfree : self._nfree + len(slots)] = slots[::-1]
        self._nfree += len(slots)
        self.removed += len(slots)

    def evict_below(self, first_row: int) -> None:
        """Remove items referring to rows the store is about to drop."""
        live = self.keys >= 0
        stale = np.flatnonzero(live & (self.rows[:, 0] < first_row))
        if len(stale):
            self.evicted += len(stale)
            self.remove(stale)
        if self.pending:
            kept: deque[Items] = deque()
            for part in self.pending:
                alive = part.rows[:, 0] >= first_row
                self.pending_items -= int((~alive).sum())
                if alive.any():
                    kept.append(Items(part.rows[alive], part.boot[alive]))
            self.pending = kept

    # ---------------------------------------------------------------- sample

    def can_sample(self, n: int) -> bool:
        return self.size > 0 and self.limiter.can_sample(n)

    def why_not(self, n: int) -> str:
        if self.size == 0 and self.limiter.inserts >= self.limiter.min_size:
            return f"table {self.name!r} is empty"
        return f"table {self.name!r}: {self.limiter.describe_wait(n)}"

    def sample(
        self, n: int, rng: np.random.Generator
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
        return self.sampler.sample(n, rng)

    def sampled(self, slots: npt.NDArray[np.int64]) -> None:
        self.limiter.sampled(len(slots))
        if self.config.max_times_sampled:
            np.add.at(self.times, slots, 1)
            done = slots[self.times[slots] >= self.config.max_times_sampled]
            if len(done):
                self.remove(done)

    def update_priorities(self, keys: npt.NDArray[np.int64], priorities: npt.NDArray[np.float64]) -> int:
        """Set priorities of live items; return how many keys were still live."""
        keys = np.asarray(keys, np.int64)
        ok = self._live(keys)
        if ok.any():
            self.sampler.update(self.slot_of(keys[ok]), np.asarray(priorities, np.float64)[ok])
        return int(ok.sum())

    def state(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "max_size": len(self.keys),
            "pending": self.pending_items,
            "removed": self.removed,
            "evicted": self.evicted,
            "sampler": self.config.sampler,
            "item": self.config.item,
            "rate_limiter": self.limiter.state(),
        }
