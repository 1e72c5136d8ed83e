"""What ``loopgate up`` starts for the ``replay`` block, and where it listens.

``PLANS["replay"]`` adds one service, ``python -m trainer.replay --config ... --run-dir
...``, and writes its addresses into the run's ``endpoints.json``::

    "replay": {"ingest": "tcp://127.0.0.1:PORT",    # the gateway's sink sends chunks here
               "sample": "tcp://127.0.0.1:PORT",    # trainers sample (ReplayClient)
               "control": "tcp://127.0.0.1:PORT"}   # status, import of demonstrations

With ``replay.enabled: false`` (the default) it plans nothing and writes nothing.
"""

from __future__ import annotations

from gateway.config import ExperimentConfig
from gateway.services import RunContext, Service, address


def replay_addresses(cfg: ExperimentConfig, run: RunContext) -> dict[str, str]:
    r = cfg.replay
    return {
        "ingest": address(cfg, run, "replay-ingest", r.ingest_port),
        "sample": address(cfg, run, "replay-sample", r.sample_port),
        "control": address(cfg, run, "replay-control", r.control_port),
    }


def plan_replay(cfg: ExperimentConfig, run: RunContext) -> list[Service]:
    if not cfg.replay.enabled:
        return []
    run.endpoints["replay"] = replay_addresses(cfg, run)
    argv = run.module(
        "trainer.replay",
        "--config",
        str(run.config_path),
        "--run-dir",
        str(run.run_dir),
        "--run-trainer-only",
    )
    # Before the gateway (order 20), so its sink finds the service at once; rebuilding
    # large tables from the log can take a while.
    return [Service(name="replay", argv=argv, order=10, ready_timeout_s=120.0, metrics=True)]
