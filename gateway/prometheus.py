"""Every service's counters and latency histograms at ``http://HOST:PORT/metrics``.

``loopgate up`` gives each service that writes metrics (the gateway, each inference
server, the replay service, the trainer, ``up`` itself) a port and writes the URLs
into ``endpoints.json`` under ``"metrics"``; :class:`~gateway.metrics.MetricsWriter`
then also serves, with prometheus-client, what it writes to ``metrics.jsonl``: every
numeric value of the service's latest record as a gauge named after its path
(``loopgate_gateway_env_steps``, ``loopgate_gateway_sink_backlog``, nested keys joined
with ``_``), and every :class:`~gateway.metrics.Histogram` it was given as a Prometheus
histogram (``loopgate_gateway_rtt_us_bucket{le=...}``). ``docs/grafana.json`` is a
dashboard over these names::

    curl -s http://127.0.0.1:PORT/metrics | grep loopgate_gateway_rtt
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import CollectorRegistry, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

_NAME = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(*parts: str) -> str:
    """A Prometheus metric name from a record's key path."""
    return _NAME.sub("_", "_".join(("loopgate", *parts))).lower()


def numeric_leaves(
    record: Mapping[str, Any], prefix: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], float]]:
    """Every finite number (bools as 0/1) in a nested record, with its key path."""
    for key, value in record.items():
        path = (*prefix, str(key))
        if isinstance(value, Mapping):
            yield from numeric_leaves(value, path)
        elif isinstance(value, (bool, int, float)) and math.isfinite(float(value)):
            yield path, float(value)


class RecordCollector(Collector):
    """The latest record of one service, and its histograms, as Prometheus metrics."""

    def __init__(self, service: str) -> None:
        self.service = service
        self._lock = threading.Lock()
        self._record: dict[str, Any] = {}
        self._histograms: dict[str, Any] = {}

    def update(self, record: Mapping[str, Any], histograms: Mapping[str, Any] | None = None) -> None:
        with self._lock:
            self._record = dict(record)
            if histograms:
                self._histograms.update(histograms)

    def collect(self) -> Iterator[Any]:
        with self._lock:
            record, histograms = self._record, dict(self._histograms)
        service = metric_name(self.service).removeprefix("loopgate_")
        seen: set[str] = set()
        for path, value in numeric_leaves(record):
            if path[0] in ("t",):
                continue
            name = metric_name(service, *path)
            if name in seen:
                continue
            seen.add(name)
            gauge = GaugeMetricFamily(name, f"{self.service}: {'.'.join(path)} (latest value)")
            gauge.add_metric([], value)
            yield gauge
        for key, hist in histograms.items():
            name = metric_name(service, key)
            family = HistogramMetricFamily(name, f"{self.service}: {key}")
            family.add_metric([], hist.cumulative_buckets(), sum_value=hist.total)
            yield family


class MetricsServer:
    """An HTTP ``/metrics`` endpoint for one service (prometheus-client's own server thread)."""

    def __init__(self, service: str, host: str, port: int) -> None:
        self.collector = RecordCollector(service)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)
        log.info("serving %s metrics at http://%s:%d/metrics", service, host, port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
