"""Samplers and the FIFO order of a table's item slots, all vectorized with numpy.

A table keeps its items in numbered slots; samplers pick slots. Every sampler has
``add(slots)``, ``remove(slots)``, ``sample(n, rng) -> (slots, probabilities)``:

- :class:`UniformSampler`: every item equally likely (with replacement);
- :class:`PrioritizedSampler`: proportional to ``priority ** exponent``, with a sum tree
  (``update(slots, priorities)`` from the trainer);
- :class:`QueueSampler`: the oldest (FIFO) or newest (LIFO) items, in order.

:class:`KeyQueue` is the insertion order the FIFO remover and the queue samplers share.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

Slots = npt.NDArray[np.int64]


class KeyQueue:
    """Item keys in insertion order, with lazy removal (stale keys are skipped)."""

    def __init__(
        self, capacity: int, valid: Callable[[npt.NDArray[np.int64]], npt.NDArray[np.bool_]]
    ) -> None:
        self._valid = valid
        self._keys = np.zeros(max(16, 2 * capacity), np.int64)
        self._head = 0
        self._tail = 0

    def push(self, keys: npt.NDArray[np.int64], live: int) -> None:
        n = len(keys)
        if self._tail + n > len(self._keys):
            self._compact(live + n)
        self._keys[self._tail : self._tail + n] = keys
        self._tail += n

    def _compact(self, need: int) -> None:
        view = self._keys[self._head : self._tail]
        keep = view[self._valid(view)]
        size = max(len(self._keys), 2 * (len(keep) + need))
        new = np.zeros(size, np.int64)
        new[: len(keep)] = keep
        self._keys, self._head, self._tail = new, 0, len(keep)

    def oldest(self, n: int) -> npt.NDArray[np.int64]:
        """Up to ``n`` live keys, oldest first (stale ones at the head are dropped)."""
        out: list[npt.NDArray[np.int64]] = []
        got = 0
        pos = self._head
        while got < n and pos < self._tail:
            block = self._keys[pos : min(self._tail, pos + max(2 * (n - got), 64))]
            live = block[self._valid(block)]
            if pos == self._head and not out and len(live) == 0:
                self._head += len(block)  # nothing live in front: forget it for good
            out.append(live[: n - got])
            got += len(out[-1])
            pos += len(block)
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def newest(self, n: int) -> npt.NDArray[np.int64]:
        """Up to ``n`` live keys, newest first."""
        out: list[npt.NDArray[np.int64]] = []
        got = 0
        pos = self._tail
        while got < n and pos > self._head:
            start = max(self._head, pos - max(2 * (n - got), 64))
            block = self._keys[start:pos][::-1]
            live = block[self._valid(block)]
            out.append(live[: n - got])
            got += len(out[-1])
            pos = start
        return np.concatenate(out) if out else np.zeros(0, np.int64)


class UniformSampler:
    """Uniform over live slots: rejection sampling over the used slot range."""

    def __init__(self, capacity: int) -> None:
        self.active = np.zeros(capacity, bool)
        self.size = 0
        self.high = 0

    def add(self, slots: Slots, priorities: npt.NDArray[np.float64] | None = None) -> None:
        self.active[slots] = True
        self.size += len(slots)
        if len(slots):
            self.high = max(self.high, int(slots.max()) + 1)

    def remove(self, slots: Slots) -> None:
        self.active[slots] = False
        self.size -= len(slots)

    def sample(self, n: int, rng: np.random.Generator) -> tuple[Slots, npt.NDArray[np.float64]]:
        prob = np.full(n, 1.0 / self.size)
        if self.size * 4 < self.high:  # sparse: pick among the live slots directly
            live = np.flatnonzero(self.active[: self.high])
            return live[rng.integers(0, len(live), n)], prob
        out = np.empty(n, np.int64)
        got = 0
        while got < n:
            cand = rng.integers(0, self.high, 2 * (n - got) + 8)
            cand = cand[self.active[cand]][: n - got]
            out[got : got + len(cand)] = cand
            got += len(cand)
        return out, prob

    def update(self, slots: Slots, priorities: npt.NDArray[np.float64]) -> None:
        return None


class PrioritizedSampler(UniformSampler):
    """Proportional prioritized sampling over a sum tree of ``priority ** exponent``."""

    def __init__(self, capacity: int, exponent: float, initial: float | None) -> None:
        super().__init__(capacity)
        self.exponent = exponent
        self.initial = initial
        self.max_priority = 1.0
        self.leaves = 1
        while self.leaves < capacity:
            self.leaves *= 2
        self.tree = np.zeros(2 * self.leaves, np.float64)

    def _set(self, slots: Slots, values: npt.NDArray[np.float64]) -> None:
        idx = slots + self.leaves
        self.tree[idx] = values
        idx = np.unique(idx // 2)
        while len(idx) and idx[0] >= 1:
            self.tree[idx] = self.tree[2 * idx] + self.tree[2 * idx + 1]
            if idx[0] == 1:
                break
            idx = np.unique(idx // 2)

    def add(self, slots: Slots, priorities: npt.NDArray[np.float64] | None = None) -> None:
        super().add(slots)
        if priorities is None:
            priorities = np.full(len(slots), self.initial or self.max_priority)
        self._set(slots, np.power(priorities, self.exponent))

    def remove(self, slots: Slots) -> None:
        super().remove(slots)
        self._set(slots, np.zeros(len(slots)))

    def update(self, slots: Slots, priorities: npt.NDArray[np.float64]) -> None:
        priorities = np.maximum(np.asarray(priorities, np.float64), 1e-12)
        if len(priorities):
            self.max_priority = max(self.max_priority, float(priorities.max()))
        self._set(slots, np.power(priorities, self.exponent))

    def sample(self, n: int, rng: np.random.Generator) -> tuple[Slots, npt.NDArray[np.float64]]:
        total = self.tree[1]
        if total <= 0:  # every priority is zero: fall back to uniform
            return super().sample(n, rng)
        # Stratified: one draw in each of n equal slices of the total mass.
        u = (np.arange(n) + rng.random(n)) * (total / n)
        idx = np.ones(n, np.int64)
        while idx[0] < self.leaves:  # in place: a fifth faster than np.where per level
            idx *= 2
            mass = self.tree.take(idx)
            right = u >= mass
            np.subtract(u, mass, out=u, where=right)
            idx += right
        slots = idx - self.leaves
        # Floating-point edges can land on an empty leaf; move those to a live one.
        dead = ~self.active[slots]
        if dead.any():
            slots[dead] = super().sample(int(dead.sum()), rng)[0]
        return slots, self.tree[slots + self.leaves] / total


class QueueSampler(UniformSampler):
    """The oldest (``fifo``) or newest (``lifo``) items, repeating when fewer than asked."""

    def __init__(
        self,
        capacity: int,
        order: KeyQueue,
        newest: bool,
        slot_of: Callable[[npt.NDArray[np.int64]], Slots],
    ) -> None:
        super().__init__(capacity)
        self.order = order
        self.newest = newest
        self.slot_of = slot_of

    def sample(self, n: int, rng: np.random.Generator) -> tuple[Slots, npt.NDArray[np.float64]]:
        keys = self.order.newest(n) if self.newest else self.order.oldest(n)
        slots = self.slot_of(keys)
        if len(slots) < n:
            slots = np.resize(slots, n)
        return slots, np.full(n, 1.0 / max(self.size, 1))
