"""Inference replicas autoscaled between ``inference.replicas`` and ``max_replicas`` on the
gateway's queue, the gateway's load balancer following, nothing lost.

Real processes throughout: ``loopgate up`` (the local engine: the autoscaler is the
driver's, the same under Ray), the gateway, MuJoCo workers, torch inference servers.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from gateway.config import ConfigError, from_dict
from gateway.metrics import read_metrics
from tests.conftest import REPO, time_left, wait_for


@pytest.mark.unit
@pytest.mark.parametrize(
    ("inference", "message"),
    [
        (
            {"replicas": 2, "max_replicas": 1},
            "inference.max_replicas (1) must be 0 (no autoscaling) or >= inference.replicas (2)",
        ),
        ({"max_replicas": 2, "scale_up_rows": 0}, "inference.scale_up_rows must be > 0, got 0"),
        ({"max_replicas": 2, "scale_window_s": -1}, "inference.scale_window_s must be > 0"),
    ],
)
def test_bad_autoscaling_settings_name_the_field(inference, message):
    with pytest.raises(ConfigError) as err:
        from_dict({"inference": {"enabled": True, **inference}})
    assert message in str(err.value)


@pytest.mark.unit
def test_autoscaling_slots_are_planned_but_not_started(tmp_path):
    from gateway.services import RunContext
    from inference.services import plan

    cfg = from_dict({"inference": {"enabled": True, "replicas": 1, "max_replicas": 3}})
    run = RunContext(run_dir=tmp_path, config_path=tmp_path / "config.yaml", endpoints={})
    services = plan(cfg, run)
    assert [s.name for s in services] == ["inference-0"]
    slots = run.endpoints["inference"]
    assert len(slots) == 3 and "autoscaled" not in slots[0]
    assert slots[1]["autoscaled"] is True and slots[2]["autoscaled"] is True
    assert len({slot["requests"] for slot in slots}) == 3


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_publication_skips_an_empty_autoscaling_slot_at_once():
    """No server in the slot: the publication does not wait for it and reports the servers
    that are there. The publisher's own timeout (an hour) is far past the test's, so a
    publication that waited for the empty slot fails by pytest-timeout, not a clock."""
    from gateway.services import free_port
    from inference.weights import WeightsPublisher

    empty = {"weights": f"tcp://127.0.0.1:{free_port()}", "autoscaled": True}
    publisher = WeightsPublisher([empty], timeout_s=3600.0)
    try:
        assert publisher.publish({"w": np.zeros(4, np.float32)}, version=1) == []
    finally:
        publisher.close()


def up_records(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    return [r for r in read_metrics(path) if r.get("service") == "up"] if path.exists() else []


def replicas_seen(run: Path) -> list[dict[str, Any]]:
    records = [r for r in up_records(run) if "policy" in r]
    return list(records[-1]["policy"].get("replicas", [])) if records else []


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_inference_replicas_follow_the_queue_and_the_balancer_follows_them(tmp_path):
    """Two workers keep more rows in flight than ``scale_up_rows`` per replica: a second
    replica starts and the gateway sends it requests. Collection paused, the queue
    empties: the extra replica stops, never the first. Every step stays accounted for."""
    cfg = {
        "env": {"backend": "mujoco_reach", "workers": 2, "num_envs": 8, "seed": 7},
        "policy": {"kind": "inference"},
        "inference": {
            "enabled": True,
            "backend": "torch",
            "network": {"hidden_sizes": [64, 64]},
            "replicas": 1,
            "max_replicas": 2,
            "scale_up_rows": 4,
            "scale_window_s": 1.0,
            "scale_cooldown_s": 2.0,
        },
    }
    config = tmp_path / "autoscale.yaml"
    config.write_text(yaml.safe_dump(cfg))
    run = tmp_path / "run"
    out = open(tmp_path / "up.log", "w")  # noqa: SIM115 - owned by the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "up", str(config), "--run-dir", str(run)],
        cwd=REPO,
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    out.close()
    from gateway.control_client import ControlClient

    control = None
    try:
        wait_for(
            lambda: len(replicas_seen(run)) == 2 and replicas_seen(run)[1]["answered"] > 50,
            timeout=120,
            interval=0.2,
            what="a second replica answering the gateway",
        )
        control = ControlClient(json.loads((run / "endpoints.json").read_text())["gateway"]["control"])
        control.request("pause", timeout_s=5.0)
        wait_for(
            lambda: any(
                "autoscale" in r and "stopped" in r["autoscale"] for r in read_metrics(run / "metrics.jsonl")
            ),
            timeout=60,
            interval=0.2,
            what="the idle extra replica to stop",
        )
        at_pause = max(int(r.get("env_steps", 0)) for r in up_records(run))
        control.request("resume", timeout_s=5.0)
        wait_for(
            lambda: max(int(r.get("env_steps", 0)) for r in up_records(run)) > at_pause + 500,
            timeout=60,
            interval=0.2,
            what="collection to go on with one replica",
        )
    finally:
        if control is not None:
            control.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=time_left())
        finally:
            if proc.poll() is None:
                proc.kill()
    log = (tmp_path / "up.log").read_text()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["outcome"] == "interrupted", log[-3000:]
    changes = [r["autoscale"] for r in read_metrics(run / "metrics.jsonl") if "autoscale" in r]
    assert changes[0]["started"] == "inference-1" and changes[0]["replicas"] == 2
    assert changes[-1]["stopped"] == "inference-1" and changes[-1]["replicas"] == 1
    assert "autoscaled inference 1 -> 2" in log and "autoscaled inference 2 -> 1" in log
    assert summary["inference"]["inference-1"]["requests"] > 0
    assert summary["acked_steps"] == summary["stored_steps"] == summary["env_steps"]
    assert summary["lost_steps"] == 0 and summary["duplicate_steps"] == 0
