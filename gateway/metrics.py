"""Counters, latency histograms and the run's ``metrics.jsonl``.

Every process appends one JSON object per line to the run's ``metrics.jsonl`` with
:class:`MetricsWriter` (``{"t": unix time, "service": "gateway", ...}``); each line is
written with a single ``write`` on an ``O_APPEND`` descriptor, so lines from
concurrent processes never interleave. :class:`Histogram` keeps log-spaced buckets so
percentiles are cheap and histograms from several processes merge exactly.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np


class Histogram:
    """Log-bucketed histogram of positive values (e.g. latencies in µs), ~2 % resolution."""

    GROWTH = 1.04
    _LOG_GROWTH = math.log(GROWTH)
    """``math.log(x, GROWTH)`` is ``math.log(x) / math.log(GROWTH)``, to the bit: one log per
    value instead of two, on the gateway's per-step path (several hops a step)."""

    def __init__(self) -> None:
        self.counts: Counter[int] = Counter()
        self.n = 0
        self.total = 0.0
        self.max = 0.0

    def _bucket(self, value: float) -> int:
        if value <= 0:
            return -10_000
        return int(math.log(value if value > 1e-9 else 1e-9) / self._LOG_GROWTH)

    def add(self, value: float) -> None:
        self.counts[self._bucket(value)] += 1
        self.n += 1
        self.total += value
        if value > self.max:
            self.max = value

    def add_array(self, values: Any) -> None:
        """:meth:`add` every value of ``values`` in one numpy pass (a batch of thousands of
        steps costs a few array operations, not one call each)."""
        v = np.asarray(values, dtype=np.float64).ravel()
        if not v.size:
            return
        logs = np.log(np.maximum(v, 1e-9)) / math.log(self.GROWTH)
        buckets = np.where(v > 0, np.trunc(logs), -10_000).astype(np.int64)  # int() truncates, as in _bucket
        for bucket, count in zip(*np.unique(buckets, return_counts=True)):
            self.counts[int(bucket)] += int(count)
        self.n += int(v.size)
        self.total += float(v.sum())
        self.max = max(self.max, float(v.max()))

    def cumulative_buckets(self) -> list[tuple[str, float]]:
        """``(upper bound, values at or below it)`` per bucket and ``+Inf``, as Prometheus
        histograms count them."""
        out, total = [], 0
        for bucket in sorted(self.counts):
            total += self.counts[bucket]
            out.append((repr(self.GROWTH ** (bucket + 1)) if bucket > -10_000 else "0.0", float(total)))
        out.append(("+Inf", float(self.n)))
        return out

    def merge(self, other: Histogram) -> None:
        self.counts.update(other.counts)
        self.n += other.n
        self.total += other.total
        self.max = max(self.max, other.max)

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile (0..100); 0.0 when empty."""
        if self.n == 0:
            return 0.0
        rank = q / 100 * self.n
        seen = 0
        for bucket in sorted(self.counts):
            seen += self.counts[bucket]
            if seen >= rank:
                return 0.0 if bucket == -10_000 else min(self.GROWTH ** (bucket + 0.5), self.max)
        return self.max

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else 0.0

    def summary(self) -> dict[str, float]:
        return {
            "n": self.n,
            "mean": round(self.mean, 3),
            "p50": round(self.percentile(50), 3),
            "p99": round(self.percentile(99), 3),
            "max": round(self.max, 3),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "b": {str(k): v for k, v in self.counts.items()},
            "n": self.n,
            "total": self.total,
            "max": self.max,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Histogram:
        h = cls()
        h.counts.update({int(k): int(v) for k, v in data.get("b", {}).items()})
        h.n, h.total, h.max = (
            int(data.get("n", 0)),
            float(data.get("total", 0.0)),
            float(data.get("max", 0.0)),
        )
        return h


HOPS = ("capture_to_gateway", "spool_write", "policy", "gateway", "action_to_worker", "env_step", "sink_ack")
"""The hops of one step, in order (each a latency in µs):

- ``capture_to_gateway``: the worker captured the observation -> the gateway received it;
- ``spool_write``: the gateway wrote the steps it completes to its spool;
- ``policy``: the gateway asked the action source -> the actions came back (inference);
- ``gateway``: the gateway received the observation -> its ACTION left (all of the above
  on the gateway's side, spool and policy included; observations held by a stop state
  are left out);
- ``action_to_worker``: the ACTION left the gateway -> the worker received it;
- ``env_step``: the worker's backend applied the action and stepped;
- ``sink_ack``: a chunk went to the sink -> the sink said it is stored durably.

Hops that cross processes compare wall clocks (``time.time``): exact on one machine,
as good as the hosts' clock sync across machines."""


class Hops:
    """One latency histogram per hop of :data:`HOPS`."""

    def __init__(self) -> None:
        self.histograms: dict[str, Histogram] = {name: Histogram() for name in HOPS}

    def add(self, hop: str, us: float) -> None:
        if us >= 0:
            self.histograms[hop].add(us)

    def summary(self) -> dict[str, dict[str, float]]:
        """p50/p99/mean/max/n per hop that has samples."""
        return {name: h.summary() for name, h in self.histograms.items() if h.n}


class MetricsWriter:
    """Appends metric records for one service to a ``metrics.jsonl`` file, and serves the
    latest at ``/metrics`` when the run's ``endpoints.json`` (beside it) gives the service
    a metrics URL (see :mod:`gateway.prometheus`)."""

    def __init__(self, path: str | Path | None, service: str, *, serve: bool = True) -> None:
        self.service = service
        self._fd: int | None = None
        self.server: Any = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            if serve:
                self.server = _metrics_server(Path(path).parent / "endpoints.json", service)

    def emit(self, record: dict[str, Any], histograms: dict[str, Histogram] | None = None) -> None:
        """Append ``record``; ``histograms`` (latency histograms by name) go to ``/metrics``
        as Prometheus histograms, as well as in the record where the caller put them."""
        if self._fd is None:
            return
        line = json.dumps({"t": round(time.time(), 3), "service": self.service, **record}, default=_plain)
        os.write(self._fd, (line + "\n").encode())
        if self.server is not None:
            self.server.collector.update(record, histograms)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.server is not None:
            self.server.close()
            self.server = None


def _metrics_server(endpoints: Path, service: str) -> Any:
    """The ``/metrics`` server at the URL ``endpoints.json`` names for ``service``, if any."""
    from urllib.parse import urlsplit

    try:
        url = json.loads(endpoints.read_text()).get("metrics", {}).get(service)
    except (OSError, ValueError):
        return None
    if not url:
        return None
    from gateway.prometheus import MetricsServer

    where = urlsplit(url)
    try:
        return MetricsServer(service, where.hostname or "127.0.0.1", int(where.port or 0))
    except OSError as exc:  # the port is taken: metrics.jsonl goes on, /metrics does not
        import logging

        logging.getLogger(__name__).warning("cannot serve %s metrics at %s: %s", service, url, exc)
        return None


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Histogram):
        return value.summary()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl`` (a torn last line from a killed process is skipped)."""
    records: list[dict[str, Any]] = []
    p = Path(path)
    if not p.exists():
        return records
    for line in p.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
