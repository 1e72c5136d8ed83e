"""How ``loopgate up`` runs the trainer: one process, or ``torchrun`` for several."""

from __future__ import annotations

import sys
from typing import Any

from gateway.config import ExperimentConfig
from gateway.services import RunContext, Service


def plan(cfg: ExperimentConfig, run: RunContext) -> list[Service]:
    tc = cfg.trainer
    if not tc.enabled:
        return []
    args = ["--config", str(run.config_path), "--run-dir", str(run.run_dir), "--log-level", run.log_level]
    if tc.nproc == 1:
        argv = [sys.executable, "-m", "trainer", *args]
    else:
        argv = [
            sys.executable,
            "-m",
            "trainer.torchrun",  # torchrun, told once (not once per thread) that `loopgate up` is gone
            "--standalone",
            f"--nproc_per_node={tc.nproc}",
            # torchrun's per-rank error files; by default a temporary folder it never removes.
            f"--log-dir={run.run_dir / 'logs' / 'torchrun'}",
            "-m",
            "trainer",
            *args,
        ]
    # After the data services: the trainer needs the replay service and inference servers up.
    return [
        Service(
            name="trainer",
            metrics=True,
            argv=argv,
            order=60,
            finishes=True,
            ready_timeout_s=120.0,
            env={"OMP_NUM_THREADS": str(tc.threads)},
        )
    ]


def preflight(cfg: ExperimentConfig, spec: Any) -> None:
    """Refuse a trainer that could not train or whose results would mislead, before anything starts."""
    from gateway.config import ConfigError, build
    from networks.config import network_problems

    tc = cfg.trainer
    if not tc.enabled:
        return
    if not cfg.replay.enabled:
        raise ConfigError("trainer.enabled needs the replay service: set replay.enabled=true")
    tables = {t.name for t in cfg.replay.tables}
    missing = sorted(set(tc.tables) - tables)
    if missing:
        raise ConfigError(
            f"trainer.tables names {missing}, which replay.tables does not define (has {sorted(tables)})"
        )
    problems = network_problems(spec, cfg.inference.network)
    if problems:
        raise ConfigError(
            "inference.network (the trainer's networks too) does not fit the env spec: " + "; ".join(problems)
        )
    if tc.target_success_rate is not None and not spec.metadata.get("success_signal", True):
        raise ConfigError(
            f"trainer.target_success_rate ({tc.target_success_rate}) needs a success signal, and "
            f"env {spec.name!r} reports none: set env.options.success_key, or trainer.target_success_rate=null"
        )
    if (tc.eval_every or tc.final_eval_episodes) and cfg.policy.kind != "inference":
        raise ConfigError(
            f"trainer evaluations would measure policy.kind {cfg.policy.kind!r}, not the trained policy: "
            "set policy.kind=inference (or trainer.eval_every=0 and trainer.final_eval_episodes=0)"
        )
    from trainer.algos import registered  # no torch: this runs before anything starts

    entry = registered(tc.algorithm)
    options = build(entry.options, dict(tc.options), "trainer.options")
    if entry.check is not None:
        entry.check(cfg, options)
    gamma = getattr(options, "gamma", None)
    for i, table in enumerate(cfg.replay.tables):
        # Batches carry the table's discount; a different trainer gamma would be ignored.
        if gamma is not None and table.name in tc.tables and abs(table.gamma - gamma) > 1e-9:
            raise ConfigError(
                f"replay.tables[{i}].gamma ({table.gamma}) differs from trainer.options.gamma ({gamma}): "
                "the discount travels with the sampled items, so set them equal"
            )
