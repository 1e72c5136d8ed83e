"""Nothing acknowledged is lost, stop states hold every driver, and nothing outlives its run.

Each test drives a real run the way a user does: their own script through
``gateway.client``, ``loopgate up`` stopped with Ctrl-C or killed outright.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from gateway.client import GatewayVectorEnv
from gateway.priority import session_niceness
from gateway.protocol import RunEnded
from tests.conftest import REPO, interrupt_when, time_left, wait_for
from tests.test_trainer_e2e import up


def external_config(tmp_path: Path, **blocks: Any) -> Path:
    cfg: dict[str, Any] = {
        "env": {"backend": "mujoco_reach", "workers": 1, "num_envs": 4, "seed": 0},
        "policy": {"kind": "external"},
        "run": {"max_env_steps": None, "status_interval_s": 0.2},
        **blocks,
    }
    path = tmp_path / "external.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def clients_address(run: Path) -> str:
    """The run's client endpoint, once its workers are registered."""
    from gateway.control_client import ControlClient

    endpoints = run / "endpoints.json"
    wait_for(lambda: endpoints.exists(), timeout=60, what="endpoints.json")
    gateway = json.loads(endpoints.read_text())["gateway"]
    control = ControlClient(gateway["control"])

    def workers() -> bool:
        from gateway.protocol import Timeout

        try:
            return bool(control.request("status", timeout_s=1.0)["workers"])
        except Timeout:
            return False

    try:
        wait_for(workers, timeout=120, interval=0.2, what="a registered worker")
    finally:
        control.close()
    return str(gateway["clients"])


def ended(proc: subprocess.Popen[str], run: Path) -> tuple[str, dict[str, Any]]:
    try:
        out, _ = proc.communicate(timeout=time_left())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    return out, json.loads((run / "summary.json").read_text())


def interrupted_with_nothing_lost(proc: subprocess.Popen[str], run: Path) -> tuple[str, dict[str, Any]]:
    """Ctrl-C to ``loopgate up``: its output and summary, which must say interrupted, with
    every acknowledged step stored exactly once."""
    proc.send_signal(signal.SIGINT)
    out, summary = ended(proc, run)
    assert summary["outcome"] == "interrupted", out[-3000:]
    assert summary["lost_steps"] == 0 and summary["duplicate_steps"] == 0, summary
    assert summary["stored_steps"] == summary["acked_steps"], summary
    return out, summary


def reach_run(tmp_path: Path, run_dir: Path, **blocks: Any) -> subprocess.Popen[str]:
    """``loopgate up`` of one worker of four reach envs until it is stopped, with ``blocks``
    (``policy``, ``inference``, ``run``, ...) added to its config."""
    cfg: dict[str, Any] = {
        "env": {"backend": "mujoco_reach", "workers": 1, "num_envs": 4, "seed": 0},
        "run": {"max_env_steps": None, "status_interval_s": 0.2},
        **blocks,
    }
    path = tmp_path / "reach.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return up(path, run_dir)


def kill_gateway_after(run: Path, steps: int) -> None:
    """``kill -9`` of the run's gateway once it has collected ``steps`` steps."""
    control = gateway_control(run)
    wait_for(
        lambda: status_or_nothing(control).get("env_steps", 0) >= steps,
        timeout=120,
        interval=0.2,
        what=f"{steps} steps collected",
    )
    control.close()
    found = subprocess.run(["pgrep", "-f", f"gateway.hub.*{run}"], capture_output=True, text=True)
    (gateway,) = [int(p) for p in found.stdout.split()]
    os.kill(gateway, signal.SIGKILL)


def gateway_control(run: Path) -> Any:
    """A control line to the run's gateway, once ``endpoints.json`` is written."""
    from gateway.control_client import ControlClient

    wait_for(lambda: (run / "endpoints.json").exists(), timeout=60, what="endpoints.json")
    return ControlClient(json.loads((run / "endpoints.json").read_text())["gateway"]["control"])


def status_or_nothing(control: Any) -> dict[str, Any]:
    """The gateway's status, or ``{}`` while it does not answer (starting, restarting)."""
    from gateway.protocol import Timeout

    try:
        return dict(control.request("status", timeout_s=2.0))
    except Timeout:
        return {}


@pytest.mark.e2e
def test_a_script_against_a_rate_limited_table_with_no_trainer_loses_nothing(tmp_path):
    """The table's samples-per-insert ratio waits for a sampler this run does not have:
    the script must be able to go on, and every step it was acknowledged must be stored."""
    table = {
        "name": "online",
        "min_size_to_sample": 200,
        "samples_per_insert": 64,
        "error_buffer": 1000,
        "max_pending": 100,
    }
    path = external_config(tmp_path, replay={"enabled": True, "tables": [table]})
    run = tmp_path / "run"
    proc = up(path, run)
    try:
        # A step held for backpressure past a minute fails the test instead of hanging it.
        venv = GatewayVectorEnv(clients_address(run), num_envs=4, timeout_s=30, hold_timeout_s=60)
        venv.reset(seed=0)
        for _ in range(300):
            venv.step(venv.action_space.sample())
        venv.close()
    except BaseException:
        proc.kill()
        raise
    _, summary = interrupted_with_nothing_lost(proc, run)
    assert summary["acked_steps"] >= 1200
    assert "is not enforced: no trainer samples it" in (run / "logs" / "replay.log").read_text()


@pytest.mark.e2e
def test_a_script_stops_exactly_at_the_step_budget_and_hears_that_the_run_ended(tmp_path):
    run = tmp_path / "run"
    proc = up(external_config(tmp_path), run, "--max-env-steps", "400")
    steps = 0
    try:
        venv = GatewayVectorEnv(clients_address(run), num_envs=4, timeout_s=30)
        venv.reset(seed=0)
        with pytest.raises(RunEnded) as info:
            for _ in range(1000):
                venv.step(venv.action_space.sample())
                steps += 4
        venv.close()
    except BaseException:
        proc.kill()
        raise
    assert "ending" in info.value.message
    out, summary = ended(proc, run)
    assert summary["outcome"] == "completed", out[-3000:]
    assert steps == summary["env_steps"] == summary["stored_steps"] == 400, (steps, summary)
    assert summary["lost_steps"] == 0


def held_step(venv: GatewayVectorEnv) -> tuple[threading.Thread, list[Any]]:
    """A step in a thread of its own (the gateway may hold it); its result or error lands in the list."""
    out: list[Any] = []

    def go() -> None:
        try:
            out.append(venv.step(venv.action_space.sample()))
        except Exception as exc:  # handed to the test thread, which asserts on it
            out.append(exc)

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread, out


@pytest.mark.integration
@pytest.mark.parametrize(
    ("engage", "release", "reason"), [("pause", "resume", "paused"), ("estop", "estop", "estop")]
)
def test_pause_and_estop_hold_a_script_driven_sim_until_released(gateway_run, engage, release, reason):
    run = gateway_run({"env": {"backend": "mujoco_reach", "num_envs": 2}, "policy": {"kind": "external"}})
    run.worker(0)
    wait_for(lambda: run.status()["workers"], what="worker registered")
    venv = GatewayVectorEnv(run.endpoints["clients"], num_envs=2, timeout_s=10)
    try:
        venv.reset(seed=0)
        for _ in range(3):
            venv.step(venv.action_space.sample())
        before = run.status()["env_steps"]
        run.control.request(engage, timeout_s=5.0, **({"engaged": True} if engage == "estop" else {}))
        thread, result = held_step(venv)
        wait_for(lambda: venv.held == reason, what=f"the step to be held ({reason})")
        wait_for(lambda: run.status()["held"] == reason, what="the gateway's status to say why")
        # The sim did not move: the held step never reached the worker.
        assert run.status()["env_steps"] == before and not result
        run.control.request(release, timeout_s=5.0, **({"engaged": False} if engage == "estop" else {}))
        thread.join(timeout=15)
        assert result and not isinstance(result[0], Exception), result
        _obs, reward, *_ = result[0]
        assert reward.shape == (2,) and venv.held is None
        venv.step(venv.action_space.sample())
        wait_for(lambda: run.status()["env_steps"] >= before + 2, what="the held step recorded")
    finally:
        venv.close()


@pytest.mark.integration
def test_a_drained_gateway_answers_held_and_new_steps_with_run_ended(gateway_run):
    run = gateway_run({"env": {"backend": "mujoco_reach", "num_envs": 2}, "policy": {"kind": "external"}})
    run.worker(0)
    wait_for(lambda: run.status()["workers"], what="worker registered")
    venv = GatewayVectorEnv(run.endpoints["clients"], num_envs=2, timeout_s=10)
    try:
        venv.reset(seed=0)
        venv.step(venv.action_space.sample())
        run.control.request("pause", timeout_s=5.0)
        thread, result = held_step(venv)
        wait_for(lambda: venv.held == "paused", what="the step to be held")
        final = run.control.request("drain", timeout_s=20.0)
        thread.join(timeout=15)
        assert result and isinstance(result[0], RunEnded), result
        assert final["drained"] and final["spooled_steps"] == 0
        with pytest.raises(RunEnded):
            venv.step(np.zeros((2, 3), np.float32))
    finally:
        venv.close()


def run_processes(run: Path) -> list[str]:
    """Command lines of live processes that belong to ``run`` (they name its folder)."""
    found = subprocess.run(["pgrep", "-af", str(run)], capture_output=True, text=True)
    return [line for line in found.stdout.splitlines() if "pgrep" not in line]


@pytest.mark.e2e
def test_killing_the_supervisor_outright_leaves_no_process_of_its_run(tmp_path):
    from tests.test_trainer_e2e import config, trainer_records

    run = tmp_path / "run"
    proc = up(config(tmp_path, max_updates=100_000), run)
    try:
        wait_for(
            lambda: len(trainer_records(run)) >= 2, timeout=240, interval=0.5, what="the trainer at work"
        )
        names = "\n".join(run_processes(run))
        assert "trainer.torchrun" in names and "gateway.worker" in names, names
        proc.kill()  # SIGKILL: no handler runs, nothing is stopped in order
        proc.wait(timeout=10)
        wait_for(lambda: not run_processes(run), timeout=45, interval=0.5, what="every service to end")
        # The replay service and the gateway went at once: the trainer's ranks must not wait
        # out their usual sample and request timeouts for them (they did, for 24 s), so that
        # torchrun never has to kill one when its 30 s shutdown limit runs out.
        trainer_log = (run / "logs" / "trainer.log").read_text()
        assert "forcefully exiting" not in trainer_log, trainer_log[-3000:]
        # torchrun heard of it once: the kernel's parent-death signal comes once for every
        # thread of the dying supervisor, and a second SIGTERM broke off torchrun's shutdown
        # ("During handling of the above exception, another exception occurred").
        assert "another exception occurred" not in trainer_log, trainer_log[-3000:]
        assert trainer_log.count("trainer stopping: signal") == 2, trainer_log[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        for line in run_processes(run):  # never leave a failed test's processes behind
            os.kill(int(line.split()[0]), signal.SIGKILL)


@pytest.mark.e2e
@pytest.mark.parametrize("budget", [300, 1500], ids=["below-what-the-trainer-needs", "mid-training"])
def test_a_spent_step_budget_ends_a_training_run_with_its_final_evaluation(tmp_path, budget):
    """300 steps never fill the table to min_size_to_sample (500): the trainer must learn
    that no more data comes. At 1500 it trains, stops, and the final evaluation runs
    outside the budget (the gateway holds budget-spent steps, but not evaluation ones)."""
    from tests.test_trainer_e2e import config

    run = tmp_path / "run"
    proc = up(config(tmp_path, max_updates=100_000, eval_every=0), run, "--max-env-steps", str(budget))
    out, summary = ended(proc, run)
    assert summary["outcome"] == "completed", out[-3000:]
    assert summary["eval_episodes"] == 8, summary
    assert summary["lost_steps"] == 0 and summary["duplicate_steps"] == 0
    log = (run / "logs" / "trainer.log").read_text()
    assert "budget is spent" in log, log[-2000:]


@pytest.mark.e2e
def test_the_first_sigint_stops_a_training_run_gracefully_and_writes_the_summary(tmp_path):
    from tests.test_trainer_e2e import config, trainer_records

    run = tmp_path / "run"
    proc = up(config(tmp_path, max_updates=100_000), run)
    try:
        wait_for(
            lambda: len(trainer_records(run)) >= 2, timeout=240, interval=0.5, what="the trainer at work"
        )
    except BaseException:
        proc.kill()
        raise
    proc.send_signal(signal.SIGINT)
    out, summary = ended(proc, run)
    assert proc.returncode == 130 and summary["outcome"] == "interrupted", out[-3000:]
    assert "stopping gracefully" in out
    # Every service ended on its SIGTERM: the trainer's ranks stopped together (while the
    # replay service and the inference servers still ran) and saved their last checkpoint.
    assert "did not stop in time" not in out, out[-3000:]
    trainer_log = (run / "logs" / "trainer.log").read_text()
    assert trainer_log.count("trainer stopping: signal") == 2, trainer_log[-3000:]
    assert "saved" in trainer_log.rsplit("trainer stopping: signal", 1)[1], trainer_log[-3000:]
    assert summary["lost_steps"] == 0 and summary["duplicate_steps"] == 0
    assert summary["stored_steps"] == summary["acked_steps"] > 0
    # The policy version is the stopped trainer's last one, the one its checkpoint holds
    # (published on its way out, after the gateway's last status).
    checkpoint = json.loads((run / "checkpoints" / "latest").read_text())
    assert summary["policy_version"] == checkpoint["version"] == trainer_records(run)[-1]["version"]
    assert not run_processes(run)


@pytest.mark.e2e
def test_ctrl_c_during_the_final_evaluation_ends_the_run_as_interrupted(tmp_path):
    """The trainer is done and ``loopgate up`` runs the final evaluation (here 10 000
    episodes, far more than the wait allows) when Ctrl-C comes: the evaluation is skipped,
    and the run ends as interrupted (exit status 130), not as completed with no
    evaluation in its summary."""
    from tests.test_trainer_e2e import config

    run = tmp_path / "run"
    path = config(tmp_path, max_updates=1, nproc=1, eval_every=0, final_eval_episodes=10_000)
    cfg = yaml.safe_load(path.read_text())
    cfg["replay"]["tables"][0]["min_size_to_sample"] = 64
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "up.log"
    with open(out, "wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "up", str(path), "--run-dir", str(run)],
            cwd=REPO,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    interrupt_when(
        proc,
        lambda: "final evaluation: waiting for 10000 evaluation episodes" in out.read_text(),
        what="the final evaluation to begin",
        timeout=240,
        interval=0.2,
    )
    summary = json.loads((run / "summary.json").read_text())
    text = out.read_text()
    assert proc.returncode == 130 and summary["outcome"] == "interrupted", text[-3000:]
    assert "final evaluation skipped: interrupted" in text, text[-3000:]
    assert "eval_episodes" not in summary or not summary["eval_episodes"], summary
    assert summary["stored_steps"] == summary["acked_steps"] > 0 and summary["lost_steps"] == 0


@pytest.mark.integration
def test_a_gateway_stopped_by_a_signal_stores_what_it_acknowledged_before_it_exits(gateway_run):
    """No drain asked for (a launch file's SIGINT, a shell's SIGTERM): the gateway closes
    its open episodes and hands its spool to the store itself."""
    from gateway.metrics import read_metrics
    from gateway.store import EpisodeStore

    run = gateway_run()
    run.worker(0)
    wait_for(lambda: run.status()["env_steps"] >= 200, what="200 steps")
    assert run.proc is not None
    os.killpg(run.proc.pid, signal.SIGTERM)
    assert run.proc.wait(timeout=30) == 0
    final = [r for r in read_metrics(run.run_dir / "metrics.jsonl") if r["service"] == "gateway"][-1]
    assert final["draining"] and final["spooled_steps"] == 0 and final["open_episodes"] == 0
    count = EpisodeStore(run.run_dir / "episodes", readonly=True).count()
    assert count.stored_steps == final["acked_steps"] >= 200 and count.duplicate_steps == 0


@pytest.mark.e2e
def test_run_nice_lowers_the_priority_of_the_named_services_only(tmp_path):
    """``run.nice`` by name prefix: every worker niced, the gateway untouched; each service
    has a session of its own, so where the kernel shares the CPU between sessions first
    (autogroup) the session is niced too, else the process's niceness would change nothing."""
    run = tmp_path / "run"
    path = external_config(tmp_path, env={"backend": "mujoco_reach", "workers": 2, "num_envs": 1})
    proc = up(path, run, "--set", "run.nice={worker: 7}")
    try:
        clients_address(run)  # the run is up, its workers registered

        def pids(pattern: str) -> list[int]:
            found = subprocess.run(["pgrep", "-f", f"{pattern}.*{run}"], capture_output=True, text=True)
            return [int(p) for p in found.stdout.split()]

        wait_for(lambda: len(pids("gateway.worker")) == 2, what="both workers")
        assert {os.getpriority(os.PRIO_PROCESS, p) for p in pids("gateway.worker")} == {7}
        assert {os.getpriority(os.PRIO_PROCESS, p) for p in pids("gateway.hub")} == {0}
        if session_niceness(os.getpid()) is not None:  # the kernel has autogroups
            assert {session_niceness(p) for p in pids("gateway.worker")} == {7}
            assert {session_niceness(p) for p in pids("gateway.hub")} == {0}
        proc.send_signal(signal.SIGINT)
    except BaseException:
        proc.kill()
        raise
    _, summary = ended(proc, run)
    assert summary["outcome"] == "interrupted"


@pytest.mark.e2e
def test_a_gateway_out_of_restarts_is_not_waited_for_at_the_end(tmp_path):
    """With no restart left (``run.max_restarts: 0``), a gateway killed (-9) fails the run,
    which then ends without waiting ``run.drain_timeout_s`` for a gateway that will not
    come back; what it had stored is counted, and its spool stays in the run folder."""
    run = tmp_path / "run"
    proc = reach_run(tmp_path, run, policy={"kind": "random"}, run={"max_env_steps": None, "max_restarts": 0})
    try:
        kill_gateway_after(run, 200)
    except BaseException:
        proc.kill()
        raise
    out, summary = ended(proc, run)
    assert summary["outcome"] == "failed", out[-3000:]
    assert "the gateway is not running (it failed" in out, out[-3000:]
    assert "draining: waiting for the gateway" not in out, out[-3000:]
    assert proc.returncode == 1
    assert list((run / "spool").iterdir()), "the dead gateway's spool is kept for the next run"


@pytest.mark.e2e
def test_ctrl_c_right_after_the_gateway_died_waits_for_its_restart_and_stores_everything(tmp_path):
    """The gateway is killed (-9) and Ctrl-C comes before the supervisor restarted it:
    the drain waits for the restarted gateway, which hands its spool to the store, so
    every step the dead one acknowledged is stored, none twice."""
    run = tmp_path / "run"
    proc = reach_run(tmp_path, run, policy={"kind": "random"})
    try:
        kill_gateway_after(run, 400)
        proc.send_signal(signal.SIGINT)
    except BaseException:
        proc.kill()
        raise
    out, summary = ended(proc, run)
    assert summary["outcome"] == "interrupted", out[-3000:]
    assert "gateway did not drain" not in out, out[-3000:]
    assert summary["acked_steps"] >= 400, summary
    assert summary["stored_steps"] == summary["acked_steps"], summary
    assert summary["lost_steps"] == 0 and summary["duplicate_steps"] == 0, summary


@pytest.mark.e2e
def test_a_full_spool_disk_holds_an_inference_driven_run_and_loses_nothing(tmp_path):
    """The inference server computes an action while the gateway writes the steps the
    observation completes; when that write fails (the spool's disk is full: a tiny tmpfs,
    mounted here, which needs root, and filled), the action must not leave, since it would
    acknowledge steps that are not on disk. Collection holds, says why, and resumes once
    the disk has room; every acknowledged step is stored exactly once."""
    from tests.test_sink_conformance import disk_full

    run = tmp_path / "run"
    spool = run / "spool"
    spool.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(spool)], capture_output=True
    )
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        proc = reach_run(
            tmp_path,
            run,
            policy={"kind": "inference"},
            inference={"enabled": True, "backend": "torch", "network": {"hidden_sizes": [16]}},
        )
        try:
            control = gateway_control(run)

            def status() -> dict[str, Any]:
                return status_or_nothing(control)

            try:
                wait_for(lambda: status().get("env_steps", 0) >= 200, timeout=120, what="200 steps")
                with disk_full(spool):
                    wait_for(lambda: status().get("held") == "storage", timeout=30, what="the hold")
                    held = status()
                    assert held["acked_steps"] == held["env_steps"], held
                    # Nothing more is acknowledged while the spool cannot write.
                    time.sleep(0.5)
                    again = status()
                    assert again["held"] == "storage" and again["acked_steps"] == held["acked_steps"], again
                wait_for(
                    lambda: status().get("acked_steps", 0) > held["acked_steps"] + 200,
                    timeout=60,
                    what="collection resumed once the disk has room",
                )
            finally:
                control.close()
        except BaseException:
            proc.kill()
            raise
        _, summary = interrupted_with_nothing_lost(proc, run)
        assert "the spool cannot write" in (run / "logs" / "gateway.log").read_text()
        assert summary["acked_steps"] > held["acked_steps"], summary
    finally:
        subprocess.run(["umount", "-l", str(spool)], capture_output=True)


@pytest.mark.e2e
def test_a_restarted_service_whose_port_another_process_took_binds_another_and_peers_follow(tmp_path):
    """The inference server is killed, and while it waits for its restart another process
    (this test) binds the port it was planned on. The restart binds a new port, written
    to ``endpoints.json``, and the gateway, already running, follows it there: collection
    resumes on the same run and nothing acknowledged is lost."""
    import socket

    from gateway.services import bindable

    run = tmp_path / "run"
    proc = reach_run(
        tmp_path,
        run,
        policy={"kind": "inference"},
        inference={"enabled": True, "backend": "torch", "network": {"hidden_sizes": [16]}},
    )
    holder = socket.socket()
    try:
        control = gateway_control(run)
        try:
            wait_for(
                lambda: status_or_nothing(control).get("env_steps", 0) >= 200, timeout=120, what="200 steps"
            )
            planned = json.loads((run / "endpoints.json").read_text())["inference"][0]["requests"]
            port = int(planned.rsplit(":", 1)[1])
            (server,) = [line for line in run_processes(run) if " -m inference " in line]
            os.kill(int(server.split()[0]), signal.SIGKILL)
            wait_for(lambda: bindable("127.0.0.1", port, reuse=True), timeout=10, what="its port freed")
            # As ZeroMQ binds: the gateway's connections to the killed server may leave the
            # port in TIME_WAIT, which refuses a bind without SO_REUSEADDR.
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            holder.bind(("127.0.0.1", port))
            holder.listen()

            def moved() -> bool:
                return json.loads((run / "endpoints.json").read_text())["inference"][0]["requests"] != planned

            wait_for(moved, timeout=30, what="endpoints.json to name its new port")
            before = status_or_nothing(control).get("acked_steps", 0)
            wait_for(
                lambda: status_or_nothing(control).get("acked_steps", 0) > before + 200,
                timeout=90,
                what="collection through the server at its new port",
            )
        finally:
            control.close()
    except BaseException:
        proc.kill()
        raise
    finally:
        holder.close()
    out, _ = interrupted_with_nothing_lost(proc, run)
    assert f"inference-0: its planned port was taken by another process; it binds {planned}" in out, out[
        -3000:
    ]
