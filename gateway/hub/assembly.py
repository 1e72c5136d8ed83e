"""Build a gateway process from an experiment config and a run folder.

Addresses come from the run's ``endpoints.json`` when it exists (``loopgate up`` writes
it before starting anything, so a restarted gateway binds the same addresses and its
workers find it again); otherwise from ``gateway.*_port`` (0 = any free port), and the
gateway writes ``endpoints.json`` itself.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from gateway import shm
from gateway.config import ExperimentConfig, load_config
from gateway.endpoints import EndpointsFollower
from gateway.episode import EnvSpec
from gateway.factory import experiment_spec
from gateway.hub.core import Gateway
from gateway.latch import LATCH_FILE
from gateway.locks import wait_to_hold
from gateway.metrics import MetricsWriter
from gateway.policies import ActionSource, InProcessSource, make_policy
from gateway.recorder import Recorder
from gateway.registry import SINKS, SOURCES, resolve
from gateway.store import EpisodeStore, StoreSink, TrajectorySink
from gateway.transport import CurveKeys, endpoint

log = logging.getLogger(__name__)


def gateway_addresses(cfg: ExperimentConfig, run_dir: Path) -> dict[str, str]:
    g = cfg.gateway
    ipc_dir = run_dir / "ipc"
    if g.transport == "ipc":
        ipc_dir.mkdir(parents=True, exist_ok=True)
    return {
        "workers": endpoint(g.transport, g.host, g.worker_port, ipc_dir, "workers"),
        "clients": endpoint(g.transport, g.host, g.client_port, ipc_dir, "clients"),
        "control": endpoint(g.transport, g.host, g.control_port, ipc_dir, "control"),
    }


def make_source(cfg: ExperimentConfig, spec: EnvSpec, endpoints: dict[str, Any]) -> ActionSource | None:
    kind = cfg.policy.kind
    if kind == "external":
        return None
    if kind in SOURCES:
        return resolve(SOURCES, kind, "action source").from_config(cfg, spec, endpoints)  # type: ignore[no-any-return]
    return InProcessSource(make_policy(kind, spec, dict(cfg.policy.options), seed=cfg.policy.seed))


def make_sink(cfg: ExperimentConfig, run_dir: Path, endpoints: dict[str, Any]) -> TrajectorySink:
    for block, _target in SINKS.items():
        if cfg.has(block) and getattr(getattr(cfg, block), "enabled", False):
            sink_cls = resolve(SINKS, block, "trajectory sink")
            return sink_cls.from_config(cfg, run_dir, endpoints)  # type: ignore[no-any-return]
    fsync = cfg.gateway.spool_fsync
    return StoreSink(EpisodeStore(run_dir / "episodes", fsync=fsync))


def build_gateway(args: argparse.Namespace) -> Gateway:
    cfg = load_config(args.config, getattr(args, "set", []) or [])
    shm.sweep_stale()  # segments of workers killed before any gateway mapped them
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    endpoints_path = Path(args.endpoints) if args.endpoints else run_dir / "endpoints.json"
    endpoints: dict[str, Any] = json.loads(endpoints_path.read_text()) if endpoints_path.exists() else {}
    addresses = endpoints.get("gateway") or gateway_addresses(cfg, run_dir)
    if args.spec:
        spec = EnvSpec.from_dict(json.loads(Path(args.spec).read_text()))
    else:
        spec = experiment_spec(cfg.env.backend, dict(cfg.env.options))
    keys = CurveKeys.load(cfg.gateway.curve_keys) if cfg.gateway.curve_keys else None
    g = cfg.gateway
    # One gateway per spool. One still stopping (its loopgate up killed, a restart's
    # predecessor) drains for up to stop_drain_s first.
    wait_to_hold(run_dir / "spool" / "LOCK", "gateway", g.stop_drain_s + 10.0, log.warning)
    recorder = Recorder(
        run_dir / "spool",
        make_sink(cfg, run_dir, endpoints),
        chunk_steps=g.chunk_steps,
        fsync=g.spool_fsync,
        fsync_interval_s=g.spool_fsync_interval_s,
    )
    recovered = recorder.recover()
    if recovered["records"]:
        log.info("resuming from spool: %s", recovered)
    max_steps = args.max_env_steps if args.max_env_steps is not None else cfg.run.max_env_steps
    trainer = getattr(cfg, "trainer", None) if cfg.has("trainer") else None
    if trainer is not None and trainer.enabled and trainer.mode == "sync":
        # Sync mode: collect the first round only; the trainer opens each next round.
        first = trainer.collect_steps
        max_steps = first if max_steps is None else min(max_steps, first)
    gateway = Gateway(
        config=g,
        source=make_source(cfg, spec, endpoints),
        recorder=recorder,
        spec=spec,
        addresses=addresses,
        keys=keys,
        metrics=MetricsWriter(run_dir / "metrics.jsonl", "gateway"),
        trace=MetricsWriter(run_dir / "trace.jsonl", "gateway", serve=False),
        max_env_steps=max_steps,
        endpoints=EndpointsFollower(endpoints_path),
        realtime_priority=cfg.run.realtime_priority,
        estop_latch=run_dir / LATCH_FILE,
    )
    if "gateway" not in endpoints:
        endpoints["gateway"] = gateway.addresses
        endpoints_path.write_text(json.dumps(endpoints, indent=2))
    return gateway
