"""The gateway's ``status`` reply: what ``loopgate status``, the console, the benchmarks
and the supervisor's ``metrics.jsonl`` records read; scripts rely on its keys."""

from __future__ import annotations

import time
from typing import Any

from gateway.local_link import ROUTE_PREFIX as LINK_ROUTE


def status_of(gw: Any) -> dict[str, Any]:
    """The status of gateway ``gw`` (a :class:`~gateway.hub.core.Gateway`)."""
    c = gw.recorder.counters
    now = time.monotonic()
    return {
        "env_steps": gw.state.env_steps,
        "episodes": c.episodes_ended,
        "episodes_interrupted": c.episodes_interrupted,
        **c.status(gw.recorder.interventions),
        "steps_per_s": round(gw.steps_per_s(now), 1),
        "rtt_p50_us": round(gw.rtt.percentile(50), 1),
        "rtt_p99_us": round(gw.rtt.percentile(99), 1),
        "rtt": gw.rtt.to_dict(),
        "hops_us": gw.timing.hops.summary(),
        "env_log": dict(gw.timing.env_log),
        "errors": dict(gw.errors),
        "paused": gw.state.paused,
        "lag_exceeded": gw.lag_exceeded,
        "eval": gw.evaluator.status(),
        **gw.lag.status(),
        "estopped": gw.state.estopped,
        "estops": gw.state.estops,
        "draining": gw.state.draining,
        "budget_reached": gw.state.budget_reached,
        "held": (held := gw.hold_reason()),
        "held_why": gw.hold_message(held) if held else None,
        "spooled_steps": gw.recorder.undelivered_steps(),
        "open_episodes": gw.recorder.open_episodes(),
        "unacked_chunks": gw.recorder.unacked_chunks,
        "sink": gw.recorder.sink.describe(),
        "sink_backlog": gw.recorder.sink.backlog(),
        "sink_blocked": gw.recorder.sink.blocked,
        "spool_bytes": gw.recorder.spool_bytes,
        "sink_bytes": gw.recorder.sink.bytes_written(),
        "policy": gw.source.describe() if gw.source else {"kind": "external"},
        "policy_version": gw.source.version if gw.source else 0,
        "uptime_s": round(now - gw.started, 1),
        "busy_s": round(gw.busy_s, 3),
        "clients_waiting": len(gw.clients.waiting),
        "workers": [
            {
                "uid": s.uid,
                "pid": s.pid,
                "num_envs": s.num_envs,
                "env_steps": s.env_steps,
                "rtt_us": round(s.rtt_us, 1),
                "silent_s": round(now - s.last_seen, 2),
                "client": s.client is not None,
                "local_link": s.route.startswith(LINK_ROUTE),
                "shm": s.shm is not None,
                "shm_bytes": s.shm_bytes,
                "cuda_ipc": s.cuda is not None,
                "frame_bytes": s.frame_bytes,
            }
            for s in gw.sessions.values()
        ],
        "spec": gw.spec.to_dict() if gw.spec else None,
    }
