"""``loopgate scale RUN env.workers=N`` on a live run: workers join and leave, and every
step is accounted for exactly, under both engines.

The Ray case runs on a three-node ``ray.cluster_utils.Cluster`` on this machine
(``benchmarks/ray_cluster.py`` says which custom resource stands for what); the joining
workers are placed wherever a node has a CPU left. Everything is real: ``loopgate up`` and
``loopgate scale`` as processes, MuJoCo workers, the gateway and its episode store.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.metrics import read_metrics
from tests.conftest import REPO, interrupt_when, loopgate, sigint_at_default, time_left, wait_for
from tests.test_trainer_e2e import up

pytestmark = pytest.mark.e2e

_STOPPED = re.compile(r"worker \S+ stopped after (\d+) env steps \((\d+) acknowledged\)")


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    from benchmarks.ray_cluster import ThreeNodes

    nodes = ThreeNodes()
    try:
        yield nodes
    finally:
        nodes.shutdown()


def up_metrics(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    return [r for r in read_metrics(path) if r.get("service") == "up"] if path.exists() else []


def env_steps(run: Path) -> int:
    return max((int(r.get("env_steps", 0)) for r in up_metrics(run)), default=0)


def running_workers(run: Path) -> list[str]:
    records = [r for r in up_metrics(run) if "services" in r]
    states = records[-1]["services"] if records else {}
    return sorted(n for n, s in states.items() if n.startswith("worker-") and s == "running")


def scale(run: Path, workers: int) -> dict[str, Any]:
    result = loopgate("scale", str(run), f"env.workers={workers}", "--timeout", "60", timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("engine", ["local", "ray"])
def test_workers_join_and_leave_a_live_run_and_every_step_is_counted_once(engine, request, tmp_path):
    cfg = {
        "env": {"backend": "mujoco_reach", "workers": 1, "num_envs": 4, "seed": 5},
        "policy": {"kind": "reach_pd"},
        "gateway": {"worker_timeout_s": 3.0},
    }
    config = tmp_path / "collect.yaml"
    config.write_text(yaml.safe_dump(cfg))
    run = tmp_path / "run"
    extra = ["--ray", request.getfixturevalue("ray_cluster").address] if engine == "ray" else []
    out = open(tmp_path / "up.log", "w")  # noqa: SIM115 - owned by the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "up", str(config), "--run-dir", str(run), *extra],
        cwd=REPO,
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    out.close()
    try:
        wait_for(lambda: env_steps(run) >= 500, timeout=90, interval=0.2, what="500 env steps")
        grown = scale(run, 3)
        assert grown["ok"] and grown["previous"] == 1 and grown["env.workers"] == 3, grown
        assert grown["started"] == ["worker-1", "worker-2"]
        wait_for(
            lambda: (
                running_workers(run) == ["worker-0", "worker-1", "worker-2"]
                and (run / "logs" / "gateway.log").read_text().count(" registered (") == 3
            ),
            timeout=90,
            interval=0.2,
            what="three workers registered with the gateway",
        )
        at_three = env_steps(run)
        wait_for(lambda: env_steps(run) >= at_three + 1000, timeout=90, interval=0.2, what="1000 more steps")
        shrunk = scale(run, 1)
        assert shrunk["ok"] and shrunk["stopped"] == ["worker-2", "worker-1"], shrunk
        wait_for(
            lambda: running_workers(run) == ["worker-0"], timeout=60, interval=0.2, what="one worker left"
        )
        at_one = env_steps(run)
        wait_for(lambda: env_steps(run) >= at_one + 500, timeout=90, interval=0.2, what="collection goes on")
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
    assert "scaled env workers 1 -> 3" in log and "scaled env workers 3 -> 1" in log
    scale_records = [r["scale"] for r in read_metrics(run / "metrics.jsonl") if "scale" in r]
    assert [r["env.workers"] for r in scale_records] == [3, 1]
    # Exact accounting: the gateway acknowledged (and stored) every step a worker heard
    # acknowledged, plus at most two observations' steps per worker that it never heard
    # acknowledged: the one in flight when it stopped, and the one before it (reach_pd runs
    # in the gateway, whose ACTION leaves before the steps are written and whose next
    # answer acknowledges them: gateway.hub.durability).
    heard, stepped = 0, 0
    for i in range(3):
        stops = _STOPPED.findall((run / "logs" / f"worker-{i}.log").read_text())
        assert len(stops) == 1, (i, stops)  # each worker ran once and stopped gracefully
        stepped += int(stops[0][0])
        heard += int(stops[0][1])
    assert heard <= summary["acked_steps"] <= stepped
    assert summary["acked_steps"] - heard <= 2 * 3 * cfg["env"]["num_envs"]
    assert summary["env_steps"] == summary["acked_steps"] == summary["stored_steps"]
    assert summary["lost_steps"] == 0 and summary["duplicate_steps"] == 0
    gateway_log = (run / "logs" / "gateway.log").read_text()
    assert gateway_log.count("said goodbye") >= 2, gateway_log[-3000:]


@pytest.mark.timeout(180)
def test_scale_refuses_an_ended_run_at_once_and_a_continued_one_is_served(tmp_path):
    """A run whose ``loopgate up`` has ended is refused at once (it waited out its whole
    timeout, 60 s, for an answer that could not come); once the folder is continued by a
    new ``loopgate up``, the same request is served."""
    cfg = {
        "env": {"backend": "mujoco_reach", "workers": 1, "num_envs": 2, "seed": 5},
        "policy": {"kind": "reach_pd"},
    }
    config = tmp_path / "collect.yaml"
    config.write_text(yaml.safe_dump(cfg))
    run = tmp_path / "run"
    done = loopgate("up", str(config), "--run-dir", str(run), "--max-env-steps", "200", timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    refused = loopgate("scale", str(run), "env.workers=2", "--timeout", "60", timeout=20)
    assert refused.returncode == 1, refused.stderr[-3000:]
    assert "has ended" in refused.stderr and "no loopgate up serves it" in refused.stderr
    assert not (run / "requests").exists()  # no request left to apply later
    proc = up(config, run, "--max-env-steps", "10000000")
    try:
        ended_at = json.loads((run / "summary.json").read_text())["env_steps"]
        wait_for(lambda: env_steps(run) > ended_at, timeout=60, what="the continued run to collect")
        assert scale(run, 2)["started"] == ["worker-1"]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=time_left())


@pytest.mark.timeout(60)
def test_an_interrupted_scale_withdraws_its_request(tmp_path):
    """Ctrl-C while ``loopgate scale`` waits (here for a ``loopgate up`` killed outright,
    which left endpoints.json and no summary.json): its request is withdrawn, so that no
    later ``loopgate up`` on the folder applies it by surprise."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "endpoints.json").write_text("{}")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "scale", str(run), "env.workers=3"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=sigint_at_default,
    )
    out = interrupt_when(
        proc,
        lambda: list((run / "requests").glob("scale-*.json")),
        what="the scale request",
        timeout=30,
        within=20,
    )
    assert proc.returncode == 130, out[-3000:]
    assert "the request is withdrawn" in out, out[-3000:]
    assert list((run / "requests").iterdir()) == []
