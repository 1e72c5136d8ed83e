"""The whole loop under ``loopgate up``: collection, replay, FSDP trainer, inference, evaluation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.endpoints import lookup
from gateway.endpoints import read as read_endpoints
from gateway.metrics import read_metrics
from tests.conftest import REPO, time_left, wait_for

pytestmark = pytest.mark.e2e


def config(tmp_path: Path, **trainer) -> Path:
    cfg = {
        "env": {"backend": "mujoco_reach", "workers": 2, "num_envs": 4, "seed": 1},
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
                    "min_size_to_sample": 500,
                    "samples_per_insert": 32,
                    "error_buffer": 20000,
                }
            ],
        },
        "trainer": {
            "enabled": True,
            "nproc": 2,
            "batch_size": 64,
            "publish_every": 10,
            "eval_every": 40,
            "eval_episodes": 8,
            "final_eval_episodes": 8,
            "checkpoint_every": 20,
            **trainer,
        },
        "run": {"max_env_steps": 10_000_000},
    }
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def up(path: Path, run: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "gateway", "up", str(path), "--run-dir", str(run), *extra],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen[str], run: Path) -> tuple[str, dict]:
    """Wait for ``loopgate up`` to end (until just before the test's own timeout); its
    output and the run's summary, which must say completed."""
    try:
        out, _ = proc.communicate(timeout=time_left())
    finally:
        if proc.poll() is None:
            proc.kill()  # its services follow it (lifeline)
            proc.wait(timeout=30)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["outcome"] == "completed", out[-3000:]
    return out, summary


def pid_of(pattern: str) -> int:
    """The first process whose command line matches ``pattern`` (``pgrep -f``)."""
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return int(found.stdout.split()[0])


def trainer_records(run: Path, key: str = "version") -> list[dict]:
    """The trainer's metrics records holding ``key``, oldest first: ``version`` for its
    periodic reports, ``eval`` for scored evaluation rounds."""
    return [r for r in read_metrics(run / "metrics.jsonl") if r.get("service") == "trainer" and key in r]


def test_up_trains_publishes_evaluates_and_plots(tmp_path):
    run = tmp_path / "run"
    _, summary = finish(up(config(tmp_path, max_updates=80), run), run)
    for key in ("eval_success_rate", "eval_return", "policy_version", "policy_lag_mean", "policy_lag_p99"):
        assert summary[key] is not None, key
    # The initial version, one publication at each multiple of publish_every after the
    # untrained round was scored (recorded with the updates done by then: how many depends
    # on how fast that round ends beside training; one that ended after the trainer stopped
    # is recorded by the final evaluation, with updates null), and the final one. A hold
    # that timed out would only publish more.
    held_until = trainer_records(run, "eval")[0]["updates"]
    expected = 2 + sum(1 for k in range(10, 81, 10) if held_until is not None and k > held_until)
    assert summary["policy_version"] >= expected, (held_until, summary["policy_version"])
    assert summary["policy_version"] == trainer_records(run)[-1]["version"]
    assert summary["eval_episodes"] == 8
    assert summary["lost_steps"] == 0 and summary["duplicate_steps"] == 0
    assert (run / "learning_curve.png").stat().st_size > 1000
    assert (run / "checkpoints" / "latest").exists()
    # Evaluation episodes are recorded but never reach a training table.
    replay = [r for r in read_metrics(run / "metrics.jsonl") if r.get("service") == "replay"]
    assert replay[-1]["eval_chunks"] > 0
    versions = [r["version"] for r in trainer_records(run)]
    assert versions == sorted(versions)
    # The learning curve's first point is the untrained policy: publication waits for it.
    rounds = trainer_records(run, "eval")
    assert rounds[0]["eval"]["policy_version"] <= 1, rounds
    # Both ranks tore their process group down before exit (no gloo thread left to
    # meet the interpreter's teardown).
    log = (run / "logs" / "trainer.log").read_text()
    assert log.count("process group closed") == 2 and "still referenced" not in log, log[-2000:]


def test_trainer_killed_mid_run_resumes_and_versions_never_go_backwards(tmp_path):
    run = tmp_path / "run"
    proc = up(config(tmp_path, max_updates=200), run)
    try:
        wait_for(
            lambda: (
                (run / "checkpoints" / "latest").exists()
                and any(r["updates"] >= 50 for r in trainer_records(run))
            ),
            timeout=300,
            what="a checkpoint and 50 updates",
        )
        pid = pid_of(f"trainer.torchrun.*{run}")
        steps_at_kill = max(r.get("env_steps", 0) for r in read_metrics(run / "metrics.jsonl"))
        os.kill(pid, signal.SIGKILL)
        wait_for(
            lambda: "resumed from step-" in (run / "logs" / "trainer.log").read_text(),
            timeout=180,
            what="the trainer to resume from its checkpoint",
        )
    except BaseException:
        proc.kill()
        raise
    out, summary = finish(proc, run)
    assert "trainer exited with" in out and "restart 1/" in out
    assert summary["env_steps"] > steps_at_kill  # collection went on
    published = [
        r.get("trainer_version", 0)
        for r in read_metrics(run / "metrics.jsonl")
        if r.get("service") == "gateway"
    ]
    assert published == sorted(published), "the gateway saw a policy version go backwards"
    served = [
        r["version"]
        for r in read_metrics(run / "metrics.jsonl")
        if str(r.get("service", "")).startswith("inference-") and "version" in r
    ]
    assert served == sorted(served)
    assert summary["lost_steps"] == 0 and summary["duplicate_steps"] == 0


def untrained_round_run(tmp_path: Path, episode_steps: int, **trainer: Any) -> Path:
    """A training config whose only evaluation is the untrained policy's round, of four
    episodes of up to ``episode_steps`` steps, with training starting after 64 steps."""
    path = config(tmp_path, eval_every=0, final_eval_episodes=0, **trainer)
    cfg = yaml.safe_load(path.read_text())
    cfg["env"]["options"] = {"max_episode_steps": episode_steps}
    cfg["replay"]["tables"][0]["min_size_to_sample"] = 64
    cfg["trainer"]["eval_every"] = 10_000  # only the untrained round
    cfg["trainer"]["eval_episodes"] = 4
    cfg["trainer"]["target_success_rate"] = None
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_publication_waits_for_the_untrained_policys_evaluation(tmp_path):
    """Long evaluation episodes and a publication per update: without the hold, version 2
    would act in the untrained round within the first few updates. The round (an episode
    under way, then the evaluation episode: at most 400 steps of each env) ends well
    within the update budget however fast the trainer runs (its end is recorded only
    while the trainer runs; measured: at update 2 to 20 of the 250)."""
    run = tmp_path / "run"
    path = untrained_round_run(tmp_path, 200, max_updates=250, publish_every=1)
    _, summary = finish(up(path, run), run)
    rounds = trainer_records(run, "eval")
    assert rounds and rounds[0]["eval"]["policy_version"] <= 1, rounds
    # Training went on meanwhile, and publication resumed once the round was scored.
    assert rounds[0]["updates"] > 0
    assert summary["policy_version"] > 10
    assert summary["lost_steps"] == 0 and summary["duplicate_steps"] == 0


def test_a_budget_spent_during_the_untrained_round_publishes_only_after_it(tmp_path):
    """Ten updates take far less than the untrained round's long episodes: the trainer
    stops while that round runs. Its last publication waits for the round to end, so that
    no episode of it acts with the trained weights (the learning curve's first point stays
    the untrained policy's), and the round is recorded with the updates done.

    The order is made, not hoped for: once the round runs and the table holds enough to
    train on, the test pauses collection (which holds the round too) until the trainer
    says it waits for the round. Left to the machine, a trainer starved of CPU (it is
    niced, collection is not) let a 1 000-step round end before its tenth update, with
    another test beside it; with 400-step rounds once alone."""
    from gateway.control_client import ControlClient

    run = tmp_path / "run"
    path = untrained_round_run(tmp_path, 1000, max_updates=10)
    proc = up(path, run)
    control: ControlClient | None = None
    try:
        control = ControlClient(
            wait_for(
                lambda: lookup(read_endpoints(run / "endpoints.json"), "gateway", "control"),
                timeout=60,
                what="endpoints.json",
            )
        )
        started: list[int] = []

        def round_under_way() -> bool:
            """The round runs and about 100 steps of each env were taken since it began
            (the round needs at least 1 000): the table has what ten updates sample."""
            status = control.request("status", timeout_s=5.0)
            if not status["eval"]["running"]:
                return False
            started[:1] = started[:1] or [int(status["env_steps"])]
            return int(status["env_steps"]) - started[0] >= 800

        wait_for(round_under_way, timeout=time_left(margin=90), interval=0.02, what="the untrained round")
        control.request("pause", timeout_s=5.0)
        waiting = "waiting for the untrained policy's evaluation round to end"
        wait_for(
            lambda: waiting in (run / "logs" / "trainer.log").read_text(),
            timeout=time_left(margin=60),
            what="the trainer to wait for the round",
        )
        control.request("resume", timeout_s=5.0)
    except BaseException:
        proc.kill()
        raise
    finally:
        if control is not None:
            control.close()
    _, summary = finish(proc, run)
    rounds = trainer_records(run, "eval")
    assert len(rounds) == 1 and rounds[0]["eval"]["policy_version"] <= 1, rounds
    assert rounds[0]["updates"] == 10, rounds
    assert summary["policy_version"] == 2  # the untrained version, then the last one
    assert summary["lost_steps"] == 0 and summary["duplicate_steps"] == 0


def test_a_budget_too_small_to_sample_from_is_reported_as_a_trainer_waiting_for_data(tmp_path):
    """A user's first try with a small budget: 100 steps, where the table needs 500 before
    it serves a batch. The trainer waits for data until collection is over and stops with
    no update. Its last record said it waited 0 % of the time (the wait that ended in the
    stop was never counted), and ``loopgate report`` named it the bottleneck, 100 % busy."""
    run = tmp_path / "run"
    path = config(tmp_path, nproc=1, eval_every=0, final_eval_episodes=0)
    _, summary = finish(up(path, run, "--max-env-steps", "100"), run)
    assert summary["lost_steps"] == 0
    last = trainer_records(run, "updates_per_s")[-1]
    assert last["updates"] == 0 and last["data_wait_frac"] == 1.0, last
    report = subprocess.run(
        [sys.executable, "-m", "gateway", "report", str(run)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=time_left(),
    )
    assert report.returncode == 0, report.stderr
    trainer_row = next(line for line in report.stdout.splitlines() if line.startswith("trainer"))
    assert "waits for data 100% of the time" in trainer_row and " 0%" in trainer_row, report.stdout
    assert "bottleneck: trainer" not in report.stdout, report.stdout


def test_an_inference_server_that_misses_publications_catches_up(tmp_path):
    run = tmp_path / "run"
    path = config(tmp_path, max_updates=160, eval_every=0, final_eval_episodes=0)
    cfg = yaml.safe_load(path.read_text())
    cfg["inference"]["replicas"] = 2
    path.write_text(yaml.safe_dump(cfg))
    proc = up(path, run)
    try:
        wait_for(lambda: any(r["version"] >= 3 for r in trainer_records(run)), timeout=300, what="version 3")
        pid = pid_of(f"inference.*{run}.*--index 1")
        os.kill(pid, signal.SIGKILL)
    except BaseException:
        proc.kill()
        raise
    out, summary = finish(proc, run)
    assert "inference-1 exited with" in out
    final = summary["inference"]
    assert final["inference-1"]["version"] == final["inference-0"]["version"] == summary["policy_version"]
    assert summary["lost_steps"] == 0


@pytest.mark.timeout(1200)
def test_the_main_job_learns_to_reach(tmp_path):
    """The demo config, shortened by an update budget (not a clock): seeded SAC through the
    whole loop must end far above the untrained policy's evaluation."""
    run = tmp_path / "run"
    _, summary = finish(
        up(
            REPO / "configs" / "reach_sim.yaml",
            run,
            "--set",
            "trainer.max_updates=8000",
            "--set",
            "trainer.target_success_rate=0.85",
            "--set",
            "trainer.final_eval_episodes=32",
            "--set",
            "run.max_env_steps=150000",
        ),
        run,
    )
    untrained = trainer_records(run, "eval")[0]["eval"]
    assert untrained["policy_version"] <= 1  # evaluated before the first update
    assert summary["eval_success_rate"] >= max(0.5, untrained["success_rate"] + 0.4), (untrained, summary)
    assert summary["eval_return"] > untrained["return_mean"] + 3.0
    assert summary["lost_steps"] == 0 and summary["duplicate_steps"] == 0


def test_sync_mode_alternates_collection_and_training(tmp_path):
    run = tmp_path / "run"
    path = config(
        tmp_path,
        mode="sync",
        collect_steps=800,
        updates_per_round=30,
        max_updates=90,
        eval_every=0,
        final_eval_episodes=0,
    )
    _, summary = finish(up(path, run), run)
    records = trainer_records(run)
    assert records[-1]["updates"] >= 90
    # Collection moves in rounds of collect_steps (the gateway's budget is raised round by
    # round) and waits while the trainer trains: about one round per 30 updates.
    assert 3 * 800 <= summary["env_steps"] <= 5 * 800 + 100
    assert summary["lost_steps"] == 0 and summary["duplicate_steps"] == 0
