"""The end of a run: drain the gateway, count what reached the store, write ``summary.json``.

:func:`drain` pauses collection and asks the gateway to close and flush every open
episode (waiting for one that is restarting, not for one out of restarts);
:func:`write_summary` reads the store back (the replay log when a replay service ran)
and compares it with what the gateway acknowledged: ``lost_steps`` is what was
acknowledged and is in neither the store nor the spool.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway.config import ExperimentConfig
from gateway.control_client import ControlClient
from gateway.metrics import Histogram
from gateway.protocol import RemoteError, Timeout
from gateway.registry import STORE_READERS, SUMMARY_HOOKS, resolve
from gateway.store import EpisodeStore
from gateway.trajectory import StoreCount

log = logging.getLogger("loopgate.up")


def count_store(cfg: ExperimentConfig, run_dir: Path) -> StoreCount:
    for block in STORE_READERS:
        if cfg.has(block) and getattr(getattr(cfg, block), "enabled", False):
            return resolve(STORE_READERS, block, "store reader")(cfg, run_dir)  # type: ignore[no-any-return]
    return EpisodeStore(run_dir / "episodes", readonly=True).count()


def write_summary(
    cfg: ExperimentConfig,
    run_dir: Path,
    status: dict[str, Any],
    elapsed: float,
    outcome: str,
    final: dict[str, Any] | None = None,
) -> dict[str, Any]:
    count = count_store(cfg, run_dir)
    acked = int(status.get("acked_steps", 0))
    # Acknowledged steps the sink had not stored when the gateway stopped are in its
    # spool, and go to the store when a gateway next starts on this run folder.
    spooled = int(status.get("spooled_steps", 0))
    if spooled:
        log.warning(
            "%d step(s) in the spool, delivered on resume (start the run again with --run-dir %s)",
            spooled,
            run_dir,
        )
    rtt = Histogram.from_dict(status.get("rtt", {}))
    env_steps = int(status.get("env_steps", 0))
    summary: dict[str, Any] = {
        "outcome": outcome,
        "env_steps": env_steps,
        "episodes": count.completed_episodes + count.interrupted_episodes,
        "completed_episodes": count.completed_episodes,
        "interrupted_episodes": count.interrupted_episodes,
        "successful_episodes": count.successful_episodes,
        "acked_steps": acked,
        "stored_steps": count.stored_steps,
        "spooled_steps": spooled,
        "lost_steps": max(0, acked - count.stored_steps - spooled),
        "duplicate_steps": count.duplicate_steps,
        "steps_per_s": round(env_steps / elapsed, 1) if elapsed > 0 else 0.0,
        "rtt_p50_us": round(rtt.percentile(50), 1),
        "rtt_p99_us": round(rtt.percentile(99), 1),
        "wall_s": round(elapsed, 1),
        "protocol_errors": status.get("errors", {}),
    }
    if status.get("trainer_version"):
        lag = status.get("policy_lag", {})
        summary.update(
            {
                "policy_version": int(status["trainer_version"]),
                "policy_lag_mean": lag.get("mean", 0.0),
                "policy_lag_p99": lag.get("p99", 0.0),
                "policy_lag_s_p99": status.get("policy_lag_s", {}).get("p99", 0.0),
            }
        )
    summary.update(final or {})
    for block in SUMMARY_HOOKS:
        if cfg.has(block):
            resolve(SUMMARY_HOOKS, block, "summary hook")(cfg, run_dir, summary)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def drain(
    control: ControlClient,
    cfg: ExperimentConfig,
    status: dict[str, Any],
    supervise: Callable[[], None] = lambda: None,
    given_up: Callable[[], bool] = lambda: False,
) -> dict[str, Any]:
    """Pause collection and flush the gateway; return its final status.

    A gateway that died or is restarting when the run stops (a crash just before Ctrl-C)
    is waited for, up to ``run.drain_timeout_s``, while ``supervise`` keeps restarting
    services: what it acknowledged is in its spool, and only a gateway running on it can
    hand that to the sink. One the supervisor gave up on (``given_up``: out of restarts)
    is not waited for: its spool stays for the next ``loopgate up`` on the run folder."""
    timeout_s = cfg.run.drain_timeout_s
    deadline = time.monotonic() + timeout_s
    while True:
        supervise()
        if given_up():
            log.error(
                "the gateway is not running (it failed; see above): nothing to drain; counting what reached the store"
            )
            return status
        try:
            control.request("pause", timeout_s=min(5.0, max(deadline - time.monotonic(), 0.5)))
            break
        except (Timeout, RemoteError) as exc:
            if time.monotonic() >= deadline:
                log.error("gateway did not drain (%s); counting what reached the store", exc)
                return status
            log.warning(
                "draining: waiting for the gateway to answer (%s), %.0f s left",
                exc,
                deadline - time.monotonic(),
            )
            time.sleep(0.2)
    try:
        # The gateway answers by its own deadline, stored or not, before ours passes.
        return control.request("drain", timeout_s=timeout_s + 5.0, deadline_s=timeout_s)
    except (Timeout, RemoteError) as exc:
        log.error("gateway did not drain (%s); counting what reached the store", exc)
        return status
