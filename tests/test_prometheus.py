"""Every service of a run serves its metrics for Prometheus at the URL in endpoints.json."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from gateway.metrics import Histogram
from gateway.prometheus import RecordCollector
from tests.conftest import REPO, time_left, wait_for


@pytest.mark.unit
def test_records_become_gauges_and_histograms_become_prometheus_histograms():
    hist = Histogram()
    for v in (100.0, 200.0, 200.0, 4000.0):
        hist.add(v)
    collector = RecordCollector("inference-0")
    collector.update(
        {"t": 1.0, "version": 3, "paused": False, "sink": "x", "queue": {"rows": 7}}, {"rtt_us": hist}
    )
    families = {f.name: f for f in collector.collect()}
    assert families["loopgate_inference_0_version"].samples[0].value == 3
    assert families["loopgate_inference_0_paused"].samples[0].value == 0
    assert families["loopgate_inference_0_queue_rows"].samples[0].value == 7
    assert "loopgate_inference_0_sink" not in families and "loopgate_inference_0_t" not in families
    buckets = [s for s in families["loopgate_inference_0_rtt_us"].samples if s.name.endswith("_bucket")]
    counts = [s.value for s in buckets]
    assert counts == sorted(counts) and counts[-1] == 4 and buckets[-1].labels["le"] == "+Inf"
    below_300 = [s.value for s in buckets if s.labels["le"] != "+Inf" and float(s.labels["le"]) < 300]
    assert max(below_300) == 3


def scrape(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return str(answer.read().decode())
    except OSError:
        return ""


@pytest.mark.e2e
def test_every_service_of_a_run_serves_metrics_at_its_url(tmp_path: Path):
    run = tmp_path / "run"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "env: {backend: mujoco_reach, workers: 1, num_envs: 2}\npolicy: {kind: reach_pd}\n"
        "replay: {enabled: true, tables: [{name: online}]}\nrun: {max_env_steps: null}\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "up", str(cfg), "--run-dir", str(run)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        endpoints = run / "endpoints.json"
        wait_for(endpoints.exists, timeout=60, what="endpoints.json")
        urls = json.loads(endpoints.read_text())["metrics"]
        assert set(urls) == {"gateway", "replay", "up"}, urls

        def steps_counted() -> bool:
            text = scrape(urls["gateway"])
            return "loopgate_gateway_rtt_us_bucket" in text and "loopgate_gateway_env_steps " in text

        wait_for(steps_counted, timeout=120, interval=0.5, what="the gateway's metrics with round trips")
        wait_for(
            lambda: "loopgate_replay_" in scrape(urls["replay"]), timeout=60, what="the replay service's"
        )
        wait_for(lambda: "loopgate_up_env_steps" in scrape(urls["up"]), timeout=60, what="loopgate up's own")
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=time_left())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert not scrape(urls["gateway"])  # the server went with its process
