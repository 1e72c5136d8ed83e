"""Runs of ``loopgate up --ray`` for ``tests/test_ray.py``: configs, the process, its log.

``up`` starts ``loopgate up`` on the cluster as its own process (its output in
``<run>-up.log`` beside the run folder); ``finish`` waits for it within the test's time
and reads ``summary.json``; ``placements`` reads where each service was placed from its
log.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from benchmarks.ray_cluster import PLACEMENT, ThreeNodes
from gateway.metrics import read_metrics
from tests.conftest import REPO, time_left

_PLACED = re.compile(r"INFO (\S+) placed on \S+ \(([0-9a-f]+)\)")


def write(tmp_path: Path, cfg: dict[str, Any]) -> Path:
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def up(cluster: ThreeNodes, config: Path, run: Path, *extra: str) -> subprocess.Popen[str]:
    out = open(run.parent / f"{run.name}-up.log", "w")  # noqa: SIM115 - owned by the process
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway",
            "up",
            str(config),
            "--run-dir",
            str(run),
            "--ray",
            cluster.address,
            *extra,
        ],
        cwd=REPO,
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out.close()
    proc.log_path = run.parent / f"{run.name}-up.log"  # type: ignore[attr-defined]
    return proc


def output(proc: subprocess.Popen[str]) -> str:
    return Path(proc.log_path).read_text(errors="replace")  # type: ignore[attr-defined]


def finish(proc: subprocess.Popen[str], run: Path, outcome: str = "completed") -> dict[str, Any]:
    try:
        proc.wait(timeout=time_left())
    finally:
        if proc.poll() is None:
            proc.kill()  # its actors (and their services) go with the driver
            proc.wait(timeout=30)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["outcome"] == outcome, output(proc)[-4000:]
    return summary


def placements(proc: subprocess.Popen[str]) -> list[tuple[str, str]]:
    """(service, node id prefix) for every placement ``loopgate up`` logged, in order."""
    return _PLACED.findall(output(proc))


def nodes_of(proc: subprocess.Popen[str], service: str) -> list[str]:
    return [node for name, node in placements(proc) if name == service]


def on(node: Any, prefix: str) -> bool:
    return str(node.node_id).startswith(prefix)


def env_steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    if not path.exists():
        return 0
    return max(
        (int(r.get("env_steps", 0)) for r in read_metrics(path) if r.get("service") == "up"), default=0
    )


def service_states(run: Path) -> dict[str, str]:
    records = [r for r in read_metrics(run / "metrics.jsonl") if r.get("service") == "up" and "services" in r]
    return dict(records[-1]["services"]) if records else {}


def learning_config() -> dict[str, Any]:
    return {
        "env": {
            "backend": "mujoco_reach",
            "workers": 2,
            "num_envs": 8,
            "seed": 1,
            "options": {"success_radius": 0.1},
        },
        "policy": {"kind": "inference"},
        "inference": {
            "enabled": True,
            "backend": "torch",
            "deterministic": False,
            "network": {"hidden_sizes": [64, 64]},
        },
        "replay": {
            "enabled": True,
            "tables": [
                {
                    "name": "online",
                    "gamma": 0.95,
                    "min_size_to_sample": 1000,
                    # One update (512 items) per 4 env steps, and collection held when the
                    # trainer falls behind: the cores go to the updates the budget counts.
                    "samples_per_insert": 128,
                    # Small slack: collection starts seconds before the trainer (Ray
                    # placement, torch imports), and whatever it stores meanwhile must be
                    # sampled off before it may go on. A 20 000-sample buffer let it run
                    # 8 800 steps ahead, more than the whole budget samples off.
                    "error_buffer": 2000,
                    "max_pending": 256,
                }
            ],
        },
        "trainer": {
            "enabled": True,
            "nproc": 2,
            # Large batches: on CPU an update of these small networks costs about the same
            # at 512 as at 128 (collectives and overheads dominate), and learns more.
            "batch_size": 512,
            "publish_every": 25,
            # 48-episode evaluations: the untrained round and the final one are the measure.
            "eval_every": 1000,
            "eval_episodes": 48,
            "final_eval_episodes": 48,
            "checkpoint_every": 500,
            "max_updates": 2500,
            "target_success_rate": 0.8,
            # An entropy weight starting at 0.1, not 1.0: from 1.0 the policy stayed near
            # uniform for most of the budget and learned on its mean alone (final returns
            # -4.4 to -5.2 in four runs, and one run with no gain at all); from 0.1, three
            # runs ended at -1.9 to -2.3 with every evaluation episode within 10 cm.
            "options": {
                "gamma": 0.95,
                "actor_lr": 0.001,
                "critic_lr": 0.001,
                "alpha_lr": 0.001,
                "init_alpha": 0.1,
            },
        },
        "run": {"max_env_steps": 10_000_000, "placement": PLACEMENT},
    }


def collection_config(workers: int = 2, **run: Any) -> dict[str, Any]:
    return {
        "env": {"backend": "mujoco_reach", "workers": workers, "num_envs": 4, "seed": 3},
        "policy": {"kind": "inference"},
        "inference": {"enabled": True, "backend": "torch", "network": {"hidden_sizes": [32, 32]}},
        "replay": {"enabled": True, "tables": [{"name": "online", "gamma": 0.95}]},
        "run": {"placement": PLACEMENT, **run},
    }
