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
import time
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
        (
            {"max_replicas": 2, "scale_up_p99": 0},
            "inference.scale_up_p99 must be > 0 (a fraction of deadline_ms) or null, got 0",
        ),
    ],
)
def test_bad_autoscaling_settings_name_the_field(inference, message):
    with pytest.raises(ConfigError) as err:
        from_dict({"inference": {"enabled": True, **inference}})
    assert message in str(err.value)


@pytest.mark.unit
def test_replicas_are_added_for_a_long_queue_or_a_p99_past_its_mark_and_removed_only_when_both_are_low():
    from gateway.engines.autoscale import latency_p99_ms, pressure

    # rows mark 64, p99 mark 50 ms
    assert pressure(100.0, 10.0, 64.0, 50.0) == ("queue", False)
    assert pressure(10.0, 80.0, 64.0, 50.0) == ("p99", False)  # short queues, too slow for the deadline
    assert pressure(10.0, 30.0, 64.0, 50.0) == (None, False)  # neither: no change either way
    assert pressure(10.0, 20.0, 64.0, 50.0) == (None, True)
    assert pressure(10.0, None, 64.0, 50.0) == (None, True)  # nothing answered lately
    assert pressure(10.0, 80.0, 64.0, None) == (None, True)  # scale_up_p99: null, the queue alone
    assert latency_p99_ms({"policy": {"latency_p99_ms": 12.5}}) == 12.5
    assert latency_p99_ms({"policy": {"latency_p99_ms": None}}) is None
    assert latency_p99_ms({}) is None


@pytest.mark.unit
def test_the_rows_in_flight_are_averaged_over_the_window_not_read_at_one_instant():
    """Little's law over the window: the rows times the latency of each answer, over the
    time the window covers; requests still unanswered count for their time so far. A
    steady light load reads as load, not as idle, to the autoscaler."""
    from gateway.engines.autoscale import pressure, queue_rows
    from inference.client import LatencyWindow

    window = LatencyWindow(window_s=5.0, since=0.0)
    assert window.rows_in_flight(0.0) == 0.0
    window.add(1.0, 0.5, rows=8)  # 8 rows for 0.5 s in the first 2 s
    assert window.rows_in_flight(2.0) == pytest.approx(2.0)
    assert window.rows_in_flight(2.0, unanswered=4 * 1.0) == pytest.approx(4.0)
    assert window.rows_in_flight(10.0) == 0.0  # the answer left the window
    short = LatencyWindow(window_s=5.0, maxlen=2, since=0.0)
    for t in (1.0, 2.0, 3.0):
        short.add(t, 0.5, rows=4)
    # The first answer was left out: the average covers only the time after it.
    assert short.rows_in_flight(3.0) == pytest.approx(2 * 4 * 0.5 / 2.0)

    # What a quiet machine showed: at the instant of the status no request was in flight,
    # but on average 3 rows were; with a mark of 4 that is neither more nor fewer replicas.
    status = {
        "policy": {
            "replicas": [
                {"up": True, "inflight_rows": 0, "inflight_rows_avg": 3.5},
                {"up": True, "inflight_rows": 0, "inflight_rows_avg": 2.5},
                {"up": False, "inflight_rows": 0, "inflight_rows_avg": 9.0},
            ],
            "waiting": 0,
        }
    }
    load, live = queue_rows(status, rows_per_request=8)
    assert (load, live) == (3.0, 2)
    assert pressure(load, 1.0, 4.0, 50.0) == (None, False)


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_the_gateway_measures_its_requests_p99_latency_over_the_last_seconds():
    """A stand-in server (a real ROUTER) that answers every request 50 ms late: the
    source's p99, overall and for the replica, is at least that; the deadline it is
    measured against travels with it; the replica's rows in flight on average count
    them after they were answered."""
    from inference.client import InferenceSource, LatencyWindow
    from tests.test_inference_client import FakeServer, obs, run_until

    server = FakeServer()
    source = InferenceSource([server.address], heartbeat_s=0.02, replica_timeout_s=5.0, deadline_ms=2000)
    try:
        run_until(source, [server], lambda: source.results() == [] and source.replicas[0].up, "server up")
        assert source.describe()["latency_p99_ms"] is None  # no answer yet
        got: list = []
        for i in range(5):
            source.submit(i, obs(), deadline=1e12)
            run_until(source, [server], lambda: bool(server.requests), "a request")
            time.sleep(0.05)
            server.answer()
            run_until(
                source, [server], lambda n=i + 1: got.extend(source.results()) or len(got) == n, "the answer"
            )
        described = source.describe()
        assert described["latency_p99_ms"] >= 50.0 and described["deadline_ms"] == 2000.0
        replica = described["replicas"][0]
        assert replica["latency_p99_ms"] >= 50.0
        # Nothing in flight now, but 4 rows were, one request at a time.
        assert replica["inflight_rows"] == 0
        assert 0.0 < replica["inflight_rows_avg"] <= 4.0
    finally:
        source.close()
        server.close()
    window = LatencyWindow(window_s=5.0)
    window.add(0.0, 0.2)
    window.add(4.0, 0.01)
    assert window.p99_ms(4.5) == pytest.approx(198.1)
    assert window.p99_ms(6.0) == pytest.approx(10.0)  # the old answer left the window
    assert window.p99_ms(20.0) is None


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
def test_requests_waiting_for_a_replica_that_is_still_loading_start_no_other(tmp_path):
    """At the start every worker's request waits for the first replica, which is still
    loading (a GPU server takes seconds): that is no load, and another replica would load
    no sooner. A real supervisor of the run; the autoscaler's window and cooldown are far
    shorter than the time it is given."""
    from gateway.engines.autoscale import Autoscaler
    from gateway.services import RunContext
    from gateway.supervisor import Supervisor
    from inference.services import plan

    cfg = from_dict(
        {
            "env": {"num_envs": 8},
            "inference": {
                "enabled": True,
                "replicas": 1,
                "max_replicas": 2,
                "scale_up_rows": 4,
                "scale_window_s": 0.05,
                "scale_cooldown_s": 0.05,
            },
        }
    )
    run = RunContext(run_dir=tmp_path, config_path=tmp_path / "config.yaml", endpoints={})
    sup = Supervisor(cfg, run, plan(cfg, run))
    autoscaler = Autoscaler(cfg, run)
    # Two workers' requests of 8 rows each: 16 rows waiting, four times the mark.
    loading = {"paused": False, "policy": {"replicas": [{"up": False}, {"up": False}], "waiting": 2}}
    try:
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            assert autoscaler.tick(sup, loading) is None
            time.sleep(0.01)
        assert sorted(sup.procs) == ["inference-0"] and autoscaler.changes == 0
    finally:
        sup.stop(timeout_s=10)


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


def start_up(tmp_path: Path, cfg: dict[str, Any], name: str) -> tuple[subprocess.Popen[bytes], Path]:
    """``loopgate up`` on ``cfg`` (written as ``name``), its output in ``up.log``."""
    config = tmp_path / name
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
    return proc, run


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
            # One replica averages about 6 rows in flight under this load (3.7 beside two
            # busy processes), two about 2.5 each: above a quarter of the mark, so the
            # second is not stopped while collection runs.
            "scale_up_rows": 2,
            "scale_window_s": 1.0,
            "scale_cooldown_s": 2.0,
        },
    }
    proc, run = start_up(tmp_path, cfg, "autoscale.yaml")
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
    # Measured on a replica that answers, not on requests waiting for the first to load.
    assert changes[0]["live"] == 1, changes
    # The idle replica stopped during the pause (after the resume the queue may grow and
    # bring it back: that is the autoscaler doing its work).
    stops = [c for c in changes if "stopped" in c]
    assert stops and stops[0]["stopped"] == "inference-1" and stops[0]["replicas"] == 1, changes
    assert "autoscaled inference 1 -> 2" in log and "autoscaled inference 2 -> 1" in log
    assert summary["inference"]["inference-1"]["requests"] > 0
    assert summary["acked_steps"] == summary["stored_steps"] == summary["env_steps"]
    assert summary["lost_steps"] == 0 and summary["duplicate_steps"] == 0


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_a_p99_latency_past_its_mark_starts_a_replica_though_the_queue_is_short(tmp_path):
    """One worker never fills a queue (``scale_up_rows`` far above what it can keep in
    flight), but the latency mark is set below any real request's (``scale_up_p99`` of a
    1 s deadline: 0.1 ms): the autoscaler starts a second replica for the p99 alone, says
    so in its log and its ``metrics.jsonl`` record, and ``loopgate up``'s records carry the
    latency it acted on. Every step stays accounted for."""
    cfg = {
        "env": {"backend": "mujoco_reach", "workers": 1, "num_envs": 4, "seed": 9},
        "policy": {"kind": "inference"},
        "inference": {
            "enabled": True,
            "backend": "torch",
            "network": {"hidden_sizes": [32, 32]},
            "replicas": 1,
            "max_replicas": 2,
            "deadline_ms": 1000.0,
            "scale_up_rows": 1_000_000,
            "scale_up_p99": 0.0001,
            "scale_window_s": 1.0,
            "scale_cooldown_s": 1.0,
        },
    }
    proc, run = start_up(tmp_path, cfg, "p99.yaml")
    try:
        wait_for(
            lambda: len(replicas_seen(run)) == 2 and replicas_seen(run)[1]["answered"] > 20,
            timeout=120,
            interval=0.2,
            what="a second replica, started for its latency, answering the gateway",
        )
    finally:
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
    first = changes[0]
    assert first["started"] == "inference-1" and first["reason"] == "p99", changes
    assert first["p99_ms"] > first["p99_mark_ms"] == pytest.approx(0.1)
    assert first["rows_per_replica"] < 1_000_000
    assert "autoscaled inference 1 -> 2 (started inference-1, p99;" in log
    seen = [r["autoscaler"] for r in up_records(run) if "autoscaler" in r]
    assert seen and seen[-1]["replicas"] == 2 and seen[-1]["p99_mark_ms"] == pytest.approx(0.1)
    assert summary["acked_steps"] == summary["stored_steps"] == summary["env_steps"]
    assert summary["lost_steps"] == 0 and summary["duplicate_steps"] == 0
