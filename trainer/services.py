"""How ``loopgate up`` runs the trainer: one process, or ``torchrun`` for several."""

from __future__ import annotations

import sys

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
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={tc.nproc}",
            "-m",
            "trainer",
            *args,
        ]
    # After the data services: the trainer needs the replay service and inference servers up.
    return [
        Service(
            name="trainer",
            argv=argv,
            order=60,
            finishes=True,
            ready_timeout_s=120.0,
            env={"OMP_NUM_THREADS": str(tc.threads)},
        )
    ]
