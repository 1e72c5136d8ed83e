"""Inference servers in whole experiments: ``loopgate up``, preflight, a server killed under load."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import pytest

from gateway.config import load_config
from gateway.control_client import ControlClient
from gateway.store import EpisodeStore
from gateway.supervisor import prepare_run
from tests.conftest import log_of, loopgate, wait_for, write_config

pytestmark = pytest.mark.e2e


def test_up_with_inference_servers_runs_the_demo_config_end_to_end(tmp_path):
    run = tmp_path / "run"
    out = loopgate(
        "up", "configs/collect_pd.yaml", "--run-dir", str(run), "--max-env-steps", "1200",
        "--set", "policy.kind=inference", "--set", "inference.enabled=true",
        "--set", "inference.network.hidden_sizes=[64,64]", "--set", "env.num_envs=4",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["outcome"] == "completed"
    assert summary["stored_steps"] == summary["acked_steps"] >= 1200
    assert summary["lost_steps"] == 0 and summary["duplicate_steps"] == 0
    served = summary["inference"]["inference-0"]
    assert served["requests"] > 0 and served["version"] == 0
    endpoints = json.loads((run / "endpoints.json").read_text())
    assert set(endpoints["inference"][0]) == {"requests", "weights", "control"}


def test_policy_inference_without_inference_enabled_fails_before_anything_starts(tmp_path):
    run = tmp_path / "run"
    out = loopgate("up", "configs/collect_pd.yaml", "--run-dir", str(run), "--set", "policy.kind=inference")
    assert out.returncode == 2
    assert "inference.enabled" in out.stderr
    assert not (run / "logs").exists()
    small = loopgate(
        "up", "configs/collect_pd.yaml", "--run-dir", str(tmp_path / "r2"), "--set", "policy.kind=inference",
        "--set", "inference.enabled=true", "--set", "env.options.camera=true",
        "--set", "env.options.image_width=8", "--set", "env.options.image_height=8",
    )  # fmt: skip
    assert small.returncode == 2 and "too small" in small.stderr


def test_a_server_killed_under_load_loses_no_step_and_rejoins_when_restarted(tmp_path, procs):
    config = write_config(
        tmp_path / "config.yaml",
        env={"backend": "mujoco_reach", "workers": 2, "num_envs": 4},
        policy={"kind": "inference"},
        gateway={"worker_timeout_s": 5.0},
        inference={
            "enabled": True,
            "replicas": 2,
            "network": {"hidden_sizes": [32, 32]},
            "heartbeat_s": 0.05,
            "replica_timeout_s": 0.5,
            "max_wait_us": 200,
        },
    )
    cfg = load_config(config)
    run, services, _ = prepare_run(cfg, tmp_path / "run", "INFO")
    started: dict[str, Any] = {}
    for service in services:
        started[service.name] = procs.spawn(*service.argv[1:], name=service.name)
    control = ControlClient(run.endpoints["gateway"]["control"])

    def status() -> dict[str, Any]:
        return control.request("status", timeout_s=5.0)

    def replicas() -> list[dict[str, Any]]:
        return status()["policy"]["replicas"]

    try:
        wait_for(lambda: status()["env_steps"] >= 300 and all(r["answered"] for r in replicas()), 90,
                 what="steps served by both servers")  # fmt: skip
        # Requests made before the servers were up fail at the gateway's deadline (the
        # gateway asks again); count from here, where both serve.
        failed_before = status()["policy"]["failed"]
        os.killpg(started["inference-0"].pid, signal.SIGKILL)
        started["inference-0"].wait(timeout=10)
        at_kill = status()["env_steps"]
        wait_for(lambda: not replicas()[0]["up"], 20, what="server 0 marked down")
        wait_for(lambda: status()["env_steps"] >= at_kill + 800, 60, what="steps after the kill")
        answered = replicas()[0]["answered"]

        restarted = next(s for s in services if s.name == "inference-0")
        procs.spawn(*restarted.argv[1:], name="inference-0-again")
        wait_for(lambda: replicas()[0]["up"] and replicas()[0]["answered"] > answered, 60,
                 what="the restarted server to serve again")  # fmt: skip

        # A server that hangs holding requests (stopped, then killed): they are retried.
        os.killpg(started["inference-1"].pid, signal.SIGSTOP)
        wait_for(lambda: not replicas()[1]["up"], 20, what="server 1 marked down")
        os.killpg(started["inference-1"].pid, signal.SIGKILL)
        at_hang = status()["env_steps"]
        wait_for(lambda: status()["env_steps"] >= at_hang + 400, 60, what="steps after the hang")

        control.request("pause", timeout_s=5.0)
        final = control.request("drain", timeout_s=30.0)
    finally:
        control.close()
    source = final["policy"]
    gateway_log = log_of(started["gateway"])
    warnings = [line for line in gateway_log.splitlines() if "WARNING" in line]
    assert source["failed"] == failed_before, (source, warnings)
    assert source["retried"] >= 1 and [r["downs"] for r in source["replicas"]] == [1, 1]
    count = EpisodeStore(run.run_dir / "episodes", readonly=True).count()
    assert count.stored_steps == final["acked_steps"] == final["env_steps"]  # zero lost steps
    assert count.duplicate_steps == 0
    for name in ("worker-0", "worker-1"):
        assert started[name].poll() is None
        assert "reconnecting" not in log_of(started[name])  # no worker ever waited past its timeout
