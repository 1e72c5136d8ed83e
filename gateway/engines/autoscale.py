"""Inference replicas that follow the load: between ``inference.replicas`` and ``max_replicas``.

``loopgate up`` (any engine) asks the gateway for its status every tick anyway; the
:class:`Autoscaler` reads the gateway's view of its inference servers from it (rows in
flight on each live replica, requests waiting for one) and

- starts the next replica when the rows per live replica stay above
  ``inference.scale_up_rows`` for ``inference.scale_window_s``, or when the p99 latency of
  the gateway's requests (its last few seconds, every replica together) stays above
  ``inference.scale_up_p99`` times ``inference.deadline_ms`` as long: replicas that keep
  queues short can still be too slow for the deadline (a slow GPU, large batches);
- stops the highest-numbered one (never below ``inference.replicas``) when the rows stay
  below a quarter of their mark and the p99 below half of its mark as long;
- waits ``inference.scale_cooldown_s`` after each change;
- changes nothing while no replica answers (at the start, while the first one loads):
  requests then wait for a replica that is loading, which says nothing about the load.

Every replica's addresses are planned at the start (``endpoints.json`` lists
``max_replicas`` entries; those beyond ``replicas`` carry ``"autoscaled": true``), so the
gateway's load balancer already heartbeats every slot: a started replica joins it as soon
as it answers (once it serves the newest policy version: the trainer's next publication
reaches it), a stopped one is marked down and its requests retried elsewhere. The
trainer's publications skip slots with no server. Each change is logged with its reason
(``queue`` or ``p99``) and appended to ``metrics.jsonl`` as ``{"autoscale": {...}}``; the
status table shows the replicas and the latency against its mark (:meth:`Autoscaler.describe`),
and ``loopgate up``'s metrics records carry it as ``autoscaler``.
"""

from __future__ import annotations

import importlib
import logging
import re
import time
from typing import Any

from gateway.config import ExperimentConfig

log = logging.getLogger("loopgate.autoscale")

REPLICA_SERVICE = "inference.services:replica_service"
_REPLICA = re.compile(r"^inference-(\d+)$")


def queue_rows(status: dict[str, Any], rows_per_request: int) -> tuple[float, int]:
    """(rows in flight or waiting per live replica, live replicas) from a gateway status;
    a request waiting for a replica is one worker's observation, ``rows_per_request`` rows.

    The rows in flight are each replica's average over the last seconds
    (``inflight_rows_avg``), not the count at the instant of the status: under a steady
    light load requests are in flight a fraction of each step, and the instant's count is
    often 0, which read as idle and stopped a replica the load still kept busy."""
    policy = status.get("policy") or {}
    replicas = [r for r in policy.get("replicas", []) if r.get("up")]
    rows = sum(float(r.get("inflight_rows_avg", r.get("inflight_rows", 0))) for r in replicas)
    rows += int(policy.get("waiting", 0)) * rows_per_request
    return rows / max(1, len(replicas)), len(replicas)


def latency_p99_ms(status: dict[str, Any]) -> float | None:
    """The p99 latency of the gateway's inference requests (ms) from its status; ``None``
    when nothing was answered lately."""
    value = (status.get("policy") or {}).get("latency_p99_ms")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def pressure(
    load: float, p99_ms: float | None, rows_mark: float, p99_mark_ms: float | None
) -> tuple[str | None, bool]:
    """Why more replicas are needed (``"queue"``, ``"p99"`` or ``None``), and whether fewer
    would do (both signals well below their marks)."""
    slow = p99_mark_ms is not None and p99_ms is not None and p99_ms > p99_mark_ms
    up = "queue" if load > rows_mark else ("p99" if slow else None)
    fast = p99_mark_ms is None or p99_ms is None or p99_ms < p99_mark_ms / 2
    return up, load < rows_mark / 4 and fast


def plan_replica(cfg: ExperimentConfig, run: Any, index: int) -> Any:
    """Replica ``index``'s service, planned as ``loopgate up`` planned the first ones."""
    module, _, attr = REPLICA_SERVICE.partition(":")
    return getattr(importlib.import_module(module), attr)(cfg, run, index)


class Autoscaler:
    """Starts and stops ``inference-<i>`` services of a run as its queue asks."""

    def __init__(self, cfg: ExperimentConfig, run: Any) -> None:
        self.cfg, self.run = cfg, run
        icfg = cfg.inference if cfg.has("inference") else None
        self.enabled = bool(icfg and icfg.enabled and icfg.max_replicas > icfg.replicas)
        self.icfg = icfg
        self.above_since: float | None = None
        self.below_since: float | None = None
        self.last_change = time.monotonic()
        self.changes = 0
        self.p99_mark_ms = (
            icfg.scale_up_p99 * icfg.deadline_ms
            if icfg is not None and icfg.scale_up_p99 is not None
            else None
        )
        """The latency above which a replica is added (``scale_up_p99`` of the deadline)."""
        self.last: dict[str, Any] = {}
        """What the last tick saw (:meth:`describe`)."""

    def running(self, sup: Any) -> list[int]:
        return sorted(int(m.group(1)) for name in sup.procs if (m := _REPLICA.match(name)))

    def tick(self, sup: Any, status: dict[str, Any], metrics: Any = None) -> dict[str, Any] | None:
        """Look at the gateway's queue once; start or stop a replica when it is time. The
        change made, if any."""
        if not self.enabled or not status or status.get("paused") is None:
            return None
        icfg = self.icfg
        assert icfg is not None
        now = time.monotonic()
        load, live = queue_rows(status, self.cfg.env.num_envs)
        p99 = latency_p99_ms(status)
        mark = icfg.scale_up_rows
        reason, idle = pressure(load, p99, mark, self.p99_mark_ms)
        self.last = {"replicas": len(self.running(sup)), "rows_per_replica": round(load, 1), "p99_ms": p99}
        if live == 0:
            # Requests wait for a replica that is still loading (at the start, or after a
            # restart), which says nothing about the load: another replica would load no
            # sooner. Only a replica that answers measures it.
            reason, idle = None, False
        self.above_since = (self.above_since or now) if reason else None
        self.below_since = (self.below_since or now) if idle else None
        if now - self.last_change < icfg.scale_cooldown_s:
            return None
        running = self.running(sup)
        change: dict[str, Any] | None = None
        if self.above_since is not None and now - self.above_since >= icfg.scale_window_s:
            free = [i for i in range(icfg.slots) if i not in running]
            if free:
                service = plan_replica(self.cfg, self.run, free[0])
                sup.start(sup.add(service))
                change = {"started": service.name, "reason": reason}
        elif self.below_since is not None and now - self.below_since >= icfg.scale_window_s:
            extra = [i for i in running if i >= icfg.replicas]
            if extra:
                name = f"inference-{extra[-1]}"
                sup.stop([name], timeout_s=self.cfg.run.drain_timeout_s)
                sup.remove(name)
                change = {"stopped": name, "reason": "idle"}
        if change is None:
            return None
        self.last_change, self.above_since, self.below_since = now, None, None
        self.changes += 1
        change.update(
            {
                "replicas": len(self.running(sup)),
                "previous": len(running),
                "rows_per_replica": round(load, 1),
                "live": live,
                "p99_ms": p99,
                "p99_mark_ms": self.p99_mark_ms,
            }
        )
        self.last["replicas"] = change["replicas"]
        log.info(
            "autoscaled inference %d -> %d (%s, %s; %.1f rows in flight per live replica, mark %.0f; "
            "p99 %s ms, mark %s ms)",
            change["previous"],
            change["replicas"],
            f"started {change['started']}" if "started" in change else f"stopped {change['stopped']}",
            change["reason"],
            load,
            mark,
            "-" if p99 is None else f"{p99:.1f}",
            "-" if self.p99_mark_ms is None else f"{self.p99_mark_ms:.0f}",
        )
        if metrics is not None:
            metrics.emit({"autoscale": change})
        return change

    def describe(self) -> dict[str, Any]:
        """The replicas and the signals the last tick saw, for the status table and
        ``loopgate up``'s metrics; empty without autoscaling."""
        if not self.enabled or not self.last:
            return {}
        p99 = self.last["p99_ms"]
        p99_text = "-" if p99 is None else f"{p99:.0f}"
        mark = "" if self.p99_mark_ms is None else f"/{self.p99_mark_ms:.0f}"
        return {
            "inference": f"{self.last['replicas']} replica(s), p99 {p99_text}{mark} ms, "
            f"{self.last['rows_per_replica']} rows/replica, {self.changes} change(s)"
        }
