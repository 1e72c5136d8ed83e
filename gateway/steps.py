"""Per-env step results in one array: the ``step_info`` of an OBSERVATION message.

Eight small per-env arrays cost eight frames on the wire, and every frame costs the
sender and the receiver more than its bytes do; so the worker packs them as one
``float64 [K, 8]`` array (every value fits a float64 exactly: counters stay below
2**53, flags are 0 or 1)::

    info = pack(episode=..., step=..., t_capture=..., has_prev=..., reward=...,
                terminated=..., truncated=..., success=...)      # [K, 8]
    steps = StepInfo(info)
    steps.reward      # float32 [K];  steps.has_prev -> bool [K]; steps.episode -> int64 [K]
"""

from __future__ import annotations

from typing import Any

import numpy as np

COLUMNS = ("episode", "step", "t_capture", "has_prev", "reward", "terminated", "truncated", "success")
"""Column order of ``step_info``."""
WIDTH = len(COLUMNS)
ENV_LOG_MAX = 64
"""At most this many simulator statistics (``meta["env_log"]``: a backend's
``info["log"]``, Isaac Lab's ``extras["log"]``) travel with one observation."""
_COL = {name: i for i, name in enumerate(COLUMNS)}


def filled(n: int, value: Any, dtype: Any = np.float64) -> np.ndarray:
    """A per-env column of ``n`` copies of ``value``: ``np.full``, at half its cost on the
    one-env batches of every step (0.53 against 1.36 us)."""
    out = np.empty(n, dtype)
    out.fill(value)
    return out


def pack(**columns: Any) -> np.ndarray:
    """``step_info`` from per-env arrays (or scalars broadcast to the batch)."""
    missing = set(COLUMNS) - set(columns)
    if missing:
        raise ValueError(f"step_info needs {sorted(missing)}")
    # A per-env array's .size without np.size's Python wrapper (eight columns a step).
    n = max(v.size if isinstance(v, np.ndarray) else np.size(v) for v in columns.values())
    out = np.empty((n, WIDTH), dtype=np.float64)
    for name, i in _COL.items():
        out[:, i] = columns[name]
    return out


class StepInfo:
    """Typed column views of a ``step_info`` array.

    The flags are ``astype(bool)`` (non-zero is true, as ``!= 0`` would say): a float
    column compared with the int ``0`` costs four times as much, several times a step."""

    __slots__ = ("a",)

    def __init__(self, array: np.ndarray) -> None:
        self.a = array

    def __len__(self) -> int:
        return len(self.a)

    @property
    def episode(self) -> np.ndarray:
        return self.a[:, 0].astype(np.int64)

    @property
    def step(self) -> np.ndarray:
        return self.a[:, 1].astype(np.int64)

    @property
    def t_capture(self) -> np.ndarray:
        return self.a[:, 2]

    @property
    def has_prev(self) -> np.ndarray:
        return self.a[:, 3].astype(bool)

    @property
    def reward(self) -> np.ndarray:
        return self.a[:, 4].astype(np.float32)

    @property
    def terminated(self) -> np.ndarray:
        return self.a[:, 5].astype(bool)

    @property
    def truncated(self) -> np.ndarray:
        return self.a[:, 6].astype(bool)

    @property
    def success(self) -> np.ndarray:
        return self.a[:, 7].astype(bool)
