"""The ``loopgate`` command end to end: ``up`` writes a complete run folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gateway.metrics import read_metrics
from tests.conftest import REPO, interrupt_when, loopgate, sigint_at_default, time_left, wait_for

pytestmark = pytest.mark.e2e

SUMMARY_KEYS = {
    "env_steps",
    "episodes",
    "acked_steps",
    "stored_steps",
    "lost_steps",
    "duplicate_steps",
    "steps_per_s",
    "rtt_p50_us",
    "rtt_p99_us",
}


def test_up_runs_to_its_budget_and_writes_the_run_folder(tmp_path):
    run = tmp_path / "run"
    out = loopgate(
        "up",
        "configs/collect_pd.yaml",
        "--run-dir",
        str(run),
        "--max-env-steps",
        "1500",
        "--set",
        "env.workers=1",
        "--set",
        "env.num_envs=4",
        "--set",
        "policy.kind=reach_pd",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for name in ("config.yaml", "endpoints.json", "metrics.jsonl", "summary.json", "spec.json"):
        assert (run / name).is_file(), name
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary) >= SUMMARY_KEYS
    assert summary["env_steps"] >= 1500
    assert summary["stored_steps"] == summary["acked_steps"] == summary["env_steps"]
    assert summary["lost_steps"] == 0 and summary["duplicate_steps"] == 0
    assert summary["successful_episodes"] > 0  # the PD controller reaches
    endpoints = json.loads((run / "endpoints.json").read_text())
    assert all(a.startswith("tcp://127.0.0.1:") for a in endpoints["gateway"].values())
    resolved = (run / "config.yaml").read_text()
    assert "num_envs: 4" in resolved and "kind: reach_pd" in resolved
    services = {r["service"] for r in read_metrics(run / "metrics.jsonl")}
    assert {"gateway", "up"} <= services


def up_collect_pd(run: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``loopgate up configs/collect_pd.yaml`` into ``run`` with ``args``; its output piped."""
    return subprocess.Popen(
        [sys.executable, "-m", "gateway", "up", "configs/collect_pd.yaml", "--run-dir", str(run), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def interrupt_once_collected(proc: subprocess.Popen[str], run: Path, steps: int) -> str:
    """Ctrl-C to ``loopgate up`` once its metrics count more than ``steps`` env steps; its output."""
    return interrupt_when(
        proc,
        lambda: any(r.get("env_steps", 0) > steps for r in read_metrics(run / "metrics.jsonl")),
        what=f"more than {steps} steps collected",
        timeout=time_left(40),
    )


def test_up_restarts_a_crashed_worker_and_loses_nothing(tmp_path):
    run = tmp_path / "run"
    proc = up_collect_pd(run, "--max-env-steps", "6000", "--set", "env.workers=1", "--set", "env.num_envs=4")
    try:
        log = run / "logs" / "worker-0.log"
        pid_line = wait_for(
            lambda: log.exists() and "registered" in (run / "logs" / "gateway.log").read_text(),
            what="worker registered",
        )
        assert pid_line
        pids = [
            int(line.split()[0])
            for line in subprocess.run(
                ["pgrep", "-f", "gateway.worker.*" + str(run)], capture_output=True, text=True
            ).stdout.split()
        ]
        assert pids
        os.kill(pids[0], signal.SIGKILL)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert "restart 1/5" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted_episodes"] >= 1
    assert summary["lost_steps"] == 0 and summary["duplicate_steps"] == 0


def test_ctrl_c_drains_and_still_writes_a_summary(tmp_path):
    run = tmp_path / "run"
    proc = up_collect_pd(run, "--set", "run.max_env_steps=null")
    out = interrupt_when(
        proc,
        lambda: (
            (run / "metrics.jsonl").exists()
            and any(r.get("env_steps", 0) > 500 for r in read_metrics(run / "metrics.jsonl"))
        ),
        what="collection",
        timeout=60,
        within=60,
    )
    assert proc.returncode == 130, out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["outcome"] == "interrupted"
    assert summary["stored_steps"] == summary["acked_steps"] > 500
    # Nothing is left running.
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", str(run)], capture_output=True, text=True).stdout.split()
    assert left == []


def test_a_console_port_in_use_is_said_and_the_run_goes_on_without_the_console(tmp_path):
    """``console.port`` taken by another program: the console once logged "console at
    http://127.0.0.1:PORT" (the other program's address), failed inside uvicorn with a
    line the supervisor did not recognise ("no error in logs/console.log"), and was
    started again five times. It now binds the port before anything else, says whose
    fault it is, exits with 2 and is not started again; the experiment goes on, and
    ``endpoints.json`` no longer gives the port as the run's console."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    run = tmp_path / "run"
    log_path = tmp_path / "up.log"
    try:
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [
                    *(
                        sys.executable,
                        "-m",
                        "gateway",
                        "up",
                        "configs/collect_pd.yaml",
                        "--run-dir",
                        str(run),
                    ),
                    *("--set", "run.max_env_steps=null", "--set", "console.enabled=true"),
                    *("--set", f"console.port={port}"),
                ],
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            interrupt_when(
                proc,
                lambda: "console refused to run; the run goes on without it" in log_path.read_text(),
                what="the console's refusal",
                timeout=time_left(40),
            )
    finally:
        taken.close()
    out = log_path.read_text()
    assert proc.returncode == 130, out[-3000:]
    assert (
        f"cannot serve the console at http://127.0.0.1:{port}: Address already in use "
        "(another program listens there?); set console.port to a free port, or 0 for any"
    ) in out
    assert "restart 1/" not in out
    assert "gateway.console: console at http" not in (run / "logs" / "console.log").read_text()
    # endpoints.json no longer names the other program's address as the run's console.
    endpoints = json.loads((run / "endpoints.json").read_text())
    assert "console" not in endpoints and "console" not in endpoints.get("metrics", {}), endpoints
    summary = json.loads((run / "summary.json").read_text())
    assert summary["outcome"] == "interrupted" and summary["stored_steps"] == summary["acked_steps"] > 0


def test_a_second_up_on_a_run_folder_in_use_is_refused_and_the_first_loses_nothing(tmp_path):
    """A second ``loopgate up`` on a live run's folder once ran beside the first: it
    rewrote ``endpoints.json`` and its gateway recorded into the same spool, and the
    first run ended with 800 steps lost and 320 stored twice. It is now refused before it
    writes anything there."""
    run = tmp_path / "run"
    first = up_collect_pd(run, "--set", "run.max_env_steps=null")
    try:
        wait_for(lambda: (run / "metrics.jsonl").exists(), timeout=time_left(60), what="the first run")
        endpoints = (run / "endpoints.json").read_text()
        second = loopgate("up", "configs/collect_pd.yaml", "--run-dir", str(run), "--max-env-steps", "500")
        assert second.returncode == 2, second.stderr[-3000:]
        assert (
            f"{run} is in use by pid {first.pid} (loopgate up): stop it first, or give this run another --run-dir"
        ) in second.stderr
        assert (run / "endpoints.json").read_text() == endpoints
        out = interrupt_once_collected(first, run, 500)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 130, out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stored_steps"] == summary["acked_steps"] > 500, summary
    assert summary["lost_steps"] == 0 and summary["duplicate_steps"] == 0, summary
    again = loopgate("up", "configs/collect_pd.yaml", "--run-dir", str(run), "--max-env-steps", "200")
    assert again.returncode == 0, again.stderr[-3000:]  # once it ended, the run continues


def test_estop_from_the_command_line_holds_a_run_and_latches_an_ended_one(tmp_path):
    """``loopgate estop RUN`` does what the console's button does; on a run that has
    ended it sets (or clears) the latch the run's next start finds."""
    run = tmp_path / "run"
    proc = up_collect_pd(run, "--set", "run.max_env_steps=null")
    try:
        wait_for(lambda: (run / "summary.json").exists() or (run / "metrics.jsonl").exists(), what="the run")
        engaged = loopgate("estop", str(run), "--reason", "cable caught", "--timeout", "10", timeout=60)
        assert engaged.returncode == 0, engaged.stderr[-2000:]
        assert json.loads(engaged.stdout)["estopped"] is True
        assert json.loads((run / "estop.json").read_text())["reason"] == "cable caught"
        from gateway.control_client import ControlClient

        control = ControlClient(json.loads((run / "endpoints.json").read_text())["gateway"]["control"])
        try:
            assert control.request("status", timeout_s=10)["held"] == "estop"
        finally:
            control.close()
        released = loopgate("estop", str(run), "--release", "--timeout", "10", timeout=60)
        assert released.returncode == 0 and json.loads(released.stdout)["estopped"] is False, released.stderr
        assert not (run / "estop.json").exists()
        out = interrupt_once_collected(proc, run, 200)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out[-3000:]
    ended = loopgate("estop", str(run), timeout=60)
    assert ended.returncode == 0 and json.loads(ended.stdout) == {"estopped": True, "running": False}
    assert "loopgate estop (" in json.loads((run / "estop.json").read_text())["reason"]
    assert loopgate("estop", str(run), "--release", timeout=60).returncode == 0
    assert not (run / "estop.json").exists()
    nowhere = loopgate("estop", str(tmp_path / "nowhere"), timeout=60)
    assert nowhere.returncode == 2 and "is not a run folder (no endpoints.json)" in nowhere.stderr


SLOW_ENV = """
import pathlib, time
import gymnasium
import numpy as np

class SlowStart(gymnasium.Env):
    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gymnasium.spaces.Box(-1.0, 1.0, (1,), np.float32)

    def __init__(self):
        pathlib.Path({marker!r}).write_text("building")
        try:
            time.sleep(300)
        except KeyboardInterrupt:  # as a third-party library may report it
            raise RuntimeError("initialization failed") from None

gymnasium.register("SlowStart-v0", entry_point=SlowStart)
"""

SLOW_INTERPRETER = """#!/bin/sh
case "$*" in
  *--write-spec*) echo $$ > {marker}; exec sleep 300 ;;
  *) exec {python} "$@" ;;
esac
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["in_process", "env_python"])
def test_ctrl_c_while_the_env_is_built_for_its_spec_ends_the_command_at_once(tmp_path, where):
    """Before any service starts, ``loopgate up`` builds the env to read its spec: in its own
    process, or in ``env.python``'s interpreter (Isaac Sim's starts in minutes). Stand-ins
    that take 300 s to build (Isaac Sim cannot run here): a Gymnasium env that reports the
    interrupt as another error, as the MuJoCo path was seen to ("initialization failed"),
    and an interpreter that sleeps once asked for the spec. Ctrl-C ends the command at
    once with 130, says it was interrupted (not "invalid config"), and leaves no process."""
    marker = tmp_path / "building"
    if where == "in_process":
        (tmp_path / "slowstart.py").write_text(SLOW_ENV.format(marker=str(marker)))
        extra = ["--set", "env.backend=gymnasium", "--set", "env.options={id: 'slowstart:SlowStart-v0'}"]
    else:
        python = tmp_path / "python"
        python.write_text(SLOW_INTERPRETER.format(marker=marker, python=sys.executable))
        python.chmod(0o755)
        extra = ["--set", f"env.python={python}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    proc = up_collect_pd(tmp_path / "run", *extra, env=env)
    out = interrupt_when(proc, marker.exists, what="the env's build to begin", timeout=60, within=30)
    builder = int(marker.read_text()) if where == "env_python" else None
    assert proc.returncode == 130, out[-3000:]
    assert "interrupted while preparing the run: no service was started" in out, out[-3000:]
    assert "invalid config" not in out and "Traceback" not in out, out[-3000:]
    if builder is not None:

        def gone() -> bool:
            try:
                os.kill(builder, 0)
            except ProcessLookupError:
                return True
            return False

        wait_for(gone, timeout=10, what="the spec's builder to end")


SLOW_IMPORT = """
import pathlib, time
pathlib.Path({marker!r}).write_text("importing")
time.sleep(300)

def main(argv):
    return 0
"""


@pytest.mark.timeout(60)
def test_ctrl_c_while_a_command_is_still_importing_ends_it_with_one_line(tmp_path):
    """A command's first second or so goes to its imports (torch, MuJoCo, rclpy), before it
    can handle Ctrl-C itself. A stand-in command whose import takes 300 s: Ctrl-C during
    it ends the command with 130 and one line, not Python's traceback."""
    marker = tmp_path / "importing"
    (tmp_path / "slowimport.py").write_text(SLOW_IMPORT.format(marker=str(marker)))
    script = (
        "import sys; from gateway import cli; "
        "cli.COMMANDS['slow'] = ('slowimport:main', 'imports for 300 s'); sys.exit(cli.main(['slow']))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=sigint_at_default,  # the command sets no handler of its own yet
    )
    out = interrupt_when(proc, marker.exists, what="the command's import to begin", timeout=30, within=20)
    assert proc.returncode == 130, out[-3000:]
    assert out.strip() == "loopgate slow: interrupted", out[-3000:]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "env.num_envs=0"], "env.num_envs must be >= 1"),
        (["--set", "env.backend=teleporter"], "env.backend: unknown backend 'teleporter'"),
        (["--set", "gateway.chunk_size=3"], "gateway: unknown key(s) chunk_size"),
        (["--set", "env.options.camera=maybe"], "env.options.camera"),
    ],
)
def test_invalid_config_fails_before_anything_starts(tmp_path, args, message):
    out = loopgate("up", "configs/collect_pd.yaml", "--run-dir", str(tmp_path / "run"), *args, timeout=60)
    assert out.returncode == 2
    assert message in out.stderr
    assert not (tmp_path / "run" / "logs").exists()


USER_ENV = """
import gymnasium as gym
import numpy as np


class Thing(gym.Env):
    metadata = {"render_fps": 50}
    observation_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float64)
    action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.np_random.uniform(-1, 1, 3), {}

    def step(self, action):
        return self.np_random.uniform(-1, 1, 3), float(action.sum()), False, False, {}


gym.register("Thing-v0", entry_point=Thing, max_episode_steps=20)
"""


@pytest.mark.parametrize("command", ["loopgate", "python -m gateway.cli"])
def test_up_in_a_project_folder_finds_its_env_and_is_not_hidden_by_its_files(tmp_path, command):
    """A researcher's own folder: their env module, and scripts named like loopgate's
    packages (``trainer.py``, ``networks.py``, ...), which once hid those packages from
    every service (``python -m`` puts the folder it starts in first on the import path)
    and from ``python -m gateway.cli`` itself."""
    for name in ("trainer", "inference", "networks", "robots", "sim_bridges", "benchmarks"):
        (tmp_path / f"{name}.py").write_text(f"raise SystemExit('the folder hid loopgate: {name}.py')\n")
    (tmp_path / "myenvs.py").write_text(USER_ENV)
    (tmp_path / "thing.yaml").write_text(
        "env: {backend: gymnasium, num_envs: 2, options: {id: 'myenvs:Thing-v0'}}\n"
        "policy: {kind: random}\n"
        "replay: {}\n"  # its service is trainer.replay, the gateway's sink trainer.replay.sink
        "run: {max_env_steps: 400}\n"
    )
    argv = (
        [str(Path(sys.executable).parent / "loopgate")]
        if command == "loopgate"
        else [sys.executable, "-m", "gateway.cli"]
    )
    out = subprocess.run(
        [*argv, "up", "thing.yaml", "--run-dir", "run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("*.log"))
    assert "the folder hid loopgate" not in out.stdout + out.stderr + logs
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["outcome"] == "completed" and summary["env_steps"] >= 400, summary
    assert summary["stored_steps"] == summary["acked_steps"] == summary["env_steps"], summary
    assert summary["lost_steps"] == 0, summary


SLOW_STEP_ENV = """
import time
import gymnasium as gym
import numpy as np


class Slow(gym.Env):
    metadata = {"render_fps": 50}
    observation_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float64)
    action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    steps = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(3), {}

    def step(self, action):
        Slow.steps += 1
        if Slow.steps == 20:
            time.sleep(9.0)  # a slow simulator step, or a robot that takes its time
        return np.zeros(3), 0.0, False, False, {}


gym.register("Slow-v0", entry_point=Slow, max_episode_steps=100)
"""


def test_an_env_step_longer_than_the_workers_timeout_keeps_its_episode(tmp_path):
    """A step of 9 s where the gateway declares a silent worker gone after 4: the worker
    said nothing meanwhile, so its episode was closed as interrupted and it registered
    again. It now sends heartbeats while the step runs (``gateway.worker.busy``)."""
    (tmp_path / "slowenv.py").write_text(SLOW_STEP_ENV)
    (tmp_path / "slow.yaml").write_text(
        "env: {backend: gymnasium, options: {id: 'slowenv:Slow-v0'}}\n"
        "policy: {kind: random}\n"
        "gateway: {worker_timeout_s: 4.0}\n"
        "run: {max_env_steps: 50}\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "up", "slow.yaml", "--run-dir", "run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=time_left(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    gateway_log = (tmp_path / "run" / "logs" / "gateway.log").read_text()
    assert "silent for" not in gateway_log and "registering again" not in out.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["episodes"] == 1 and summary["completed_episodes"] == 0, summary  # one, cut by the budget
    assert summary["stored_steps"] == summary["acked_steps"] >= 50, summary


def test_an_env_module_nowhere_to_be_found_is_refused_saying_where_it_was_looked_for(tmp_path):
    (tmp_path / "thing.yaml").write_text("env: {backend: gymnasium, options: {id: 'myenvs:Thing-v0'}}\n")
    out = subprocess.run(
        [str(Path(sys.executable).parent / "loopgate"), "up", "thing.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert (
        f"env.options.id 'myenvs:Thing-v0' cannot be imported: no module 'myenvs' among the installed "
        f"packages or in {tmp_path} (the folder loopgate was started in)"
    ) in out.stderr


def test_a_run_folder_that_cannot_be_made_is_refused_in_one_line(tmp_path):
    """It ended in a ``FileExistsError`` or ``PermissionError`` traceback."""
    (tmp_path / "a-file").write_text("")
    out = loopgate("up", "configs/collect_pd.yaml", "--run-dir", str(tmp_path / "a-file" / "run"), timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert (
        f"cannot use the run folder {tmp_path / 'a-file' / 'run'}: [Errno 20] Not a directory" in out.stderr
    )


def test_help_shows_runnable_examples():
    out = loopgate("--help")
    assert out.returncode == 0 and "loopgate up configs/reach_sim.yaml" in out.stdout
    for command in ("up", "gateway", "worker", "doctor", "keys", "bench"):
        sub = loopgate(command, "--help", timeout=60)
        assert sub.returncode == 0, (command, sub.stderr)
        assert "example" in sub.stdout, command
    assert loopgate("--version").stdout.startswith("loopgate ")


def test_doctor_reports_what_is_installed():
    out = loopgate("doctor", "--json", timeout=120)
    assert out.returncode == 0
    checks = {c["name"]: c for c in json.loads(out.stdout)["checks"]}
    assert checks["pyzmq"]["ok"] and checks["mujoco"]["ok"]
    assert all(c["ok"] or c["fix"] for c in checks.values())
    # ROS 2's launch is reported either way (docs/ros2.md sends users here for it).
    assert "ros2 launch" in checks and "launch" in checks["ros2 launch"]["detail"]
    # How run.nice acts on this machine (docs/architecture.md).
    assert "CPU(s)" in checks["scheduling"]["detail"] and "autogroup" in checks["scheduling"]["detail"]
    assert "run.realtime_priority" in checks["scheduling"]["detail"]
    assert "real-time budget" in checks["scheduling"]["detail"]


def test_keys_are_made_once_and_not_overwritten(tmp_path):
    assert loopgate("keys", str(tmp_path / "k")).returncode == 0
    assert (tmp_path / "k" / "server.key_secret").exists() and (
        tmp_path / "k" / "authorized" / "client.key"
    ).exists()
    again = loopgate("keys", str(tmp_path / "k"))
    assert again.returncode == 2 and "refusing to overwrite" in again.stderr


def test_up_over_ipc_sockets(tmp_path):
    run = tmp_path / "run"
    out = loopgate(
        "up",
        "configs/collect_pd.yaml",
        "--run-dir",
        str(run),
        "--max-env-steps",
        "800",
        "--set",
        "gateway.transport=ipc",
        "--set",
        "env.workers=1",
        "--set",
        "env.num_envs=4",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    endpoints = json.loads((run / "endpoints.json").read_text())["gateway"]
    assert all(a.startswith("ipc://") for a in endpoints.values())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stored_steps"] == summary["acked_steps"] >= 800 and summary["lost_steps"] == 0
