"""The training view's data: curves read from the run's own ``metrics.jsonl``.

Every loopgate process appends JSON lines there (:mod:`gateway.metrics`); this module
follows the file from where it last stopped and keeps the newest ``max_points`` of a
few series, so a long run costs the console a bounded amount of memory::

    tail = MetricsTail(run_dir / "metrics.jsonl")
    tail.series()   # {"steps_per_s": {"x": [unix t...], "y": [...]}, "success_rate": ...}
    tail.histograms()   # {"policy_lag": {"0": 1200, "1": 340, ...}}: the newest only

A series named ``group/member`` is one line of a chart with several (the page draws
``hop_p50/policy`` and ``hop_p50/env_step`` in one chart): per-hop latency p50 and p99
(the gateway's ``hops_us``), each replay table's fill (size / max_size) and its
samples per insert (sampled items / inserted items, what ``samples_per_insert`` holds).

A torn last line (a writer mid-append) is left for the next read.
"""

from __future__ import annotations

import json
import math
import threading
from collections import deque
from pathlib import Path
from typing import Any

SERIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "steps_per_s": ("up", ("steps_per_s",)),
    "rtt_p50_us": ("up", ("rtt_p50_us",)),
    "rtt_p99_us": ("up", ("rtt_p99_us",)),
    "policy_lag_mean": ("up", ("policy_lag", "mean")),
    "success_rate": ("trainer", ("eval", "success_rate")),
    "return_mean": ("trainer", ("eval", "return_mean")),
    "updates_per_s": ("trainer", ("updates_per_s",)),
    "intervention_rate": ("gateway", ("intervention_rate",)),
}
"""Series name -> (the service whose lines carry it, the path of keys to the value)."""

LOSS_SUFFIX = "loss"
"""Trainer values whose key ends so (``critic_loss``, ``actor_loss``, ...) become series too."""


def _lookup(record: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = record
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


class MetricsTail:
    def __init__(self, path: Path, max_points: int = 2000) -> None:
        self.path = path
        self.max_points = max_points
        self._offset = 0
        self._lock = threading.Lock()
        self._series: dict[str, tuple[deque[float], deque[float]]] = {}
        self._histograms: dict[str, dict[str, int]] = {}

    def _add(self, name: str, t: float, value: float) -> None:
        if name not in self._series:
            self._series[name] = (deque(maxlen=self.max_points), deque(maxlen=self.max_points))
        xs, ys = self._series[name]
        xs.append(t)
        ys.append(value)

    def _take(self, record: dict[str, Any]) -> None:
        t, service = record.get("t"), record.get("service")
        if not isinstance(t, (int, float)):
            return
        for name, (source, path) in SERIES.items():
            if service == source and (value := _lookup(record, path)) is not None:
                self._add(name, float(t), value)
        if service == "trainer":
            for key in list(record):
                if key.endswith(LOSS_SUFFIX) and (v := _lookup(record, (key,))) is not None:
                    self._add(key, float(t), v)
        if service == "gateway":
            self._gateway(record, float(t))
        if service == "replay":
            self._replay(record, float(t))

    def _gateway(self, record: dict[str, Any], t: float) -> None:
        hops = record.get("hops_us")
        if isinstance(hops, dict):
            for hop, summary in hops.items():
                for q in ("p50", "p99"):
                    if (v := _lookup(summary if isinstance(summary, dict) else {}, (q,))) is not None:
                        self._add(f"hop_{q}/{hop}", t, v)
        hist = record.get("policy_lag_hist")
        if isinstance(hist, dict) and all(isinstance(v, int) for v in hist.values()):
            self._histograms["policy_lag"] = {str(k): int(v) for k, v in hist.items()}

    def _replay(self, record: dict[str, Any], t: float) -> None:
        tables = record.get("tables")
        if not isinstance(tables, dict):
            return
        for name, table in tables.items():
            if not isinstance(table, dict):
                continue
            size, cap = _lookup(table, ("size",)), _lookup(table, ("max_size",))
            if size is not None and cap:
                self._add(f"replay_fill/{name}", t, size / cap)
            inserts = _lookup(table, ("rate_limiter", "inserts"))
            samples = _lookup(table, ("rate_limiter", "samples"))
            if inserts and samples is not None:
                self._add(f"samples_per_insert/{name}", t, samples / inserts)

    def read(self) -> None:
        """Take the lines appended since the last read."""
        with self._lock:
            try:
                with self.path.open("rb") as f:
                    f.seek(self._offset)
                    data = f.read()
            except FileNotFoundError:
                return
            end = data.rfind(b"\n")
            if end < 0:
                return
            self._offset += end + 1
            for line in data[: end + 1].splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a corrupt line costs one point, not the view
                if isinstance(record, dict):
                    self._take(record)

    def series(self) -> dict[str, dict[str, list[float]]]:
        self.read()
        with self._lock:
            return {name: {"x": list(xs), "y": list(ys)} for name, (xs, ys) in self._series.items()}

    def histograms(self) -> dict[str, dict[str, int]]:
        """The newest histograms (policy lag in versions -> steps); call after :meth:`series`."""
        with self._lock:
            return {name: dict(h) for name, h in self._histograms.items()}
