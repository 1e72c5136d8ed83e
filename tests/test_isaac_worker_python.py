"""Env workers in another interpreter than the gateway's (``env.python``), as Isaac Sim needs.

Isaac Sim 6.x brings Python 3.12 while loopgate's venv may be 3.11: these tests make a
second venv on another minor version when the machine has one (else a second venv of
this Python), install loopgate there with the ``worker`` extra only (numpy, pyzmq,
msgspec, PyYAML: no MuJoCo, no torch, no rich), and collect through a real gateway from
a worker running in it. A bad ``env.python`` is a configuration error naming the fix.
"""

from __future__ import annotations

import glob
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, loopgate, time_left

pytestmark = pytest.mark.e2e


def other_python() -> str:
    """An interpreter of another minor version than this one (3.12 or 3.13), else this one."""
    mine = f"{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [shutil.which(f"python{v}") for v in ("3.12", "3.13")]
    candidates += sorted(glob.glob(str(Path.home() / ".pyenv" / "versions" / "3.1[23]*" / "bin" / "python3")))
    for exe in filter(None, candidates):
        out = subprocess.run(
            [exe, "-c", "import sys, venv; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if out.returncode == 0 and out.stdout.strip() not in ("", mine):
            return exe
    return sys.executable


def config(tmp_path: Path, python: str, **env: object) -> Path:
    path = tmp_path / "experiment.yaml"
    blocks = {
        "env": {
            "backend": "counter",
            "python": python,
            "num_envs": 4,
            "options": {"max_episode_steps": 5},
            **env,
        },
        "policy": {"kind": "random"},
        "gateway": {"chunk_steps": 16},
    }
    path.write_text(yaml.safe_dump(blocks))
    return path


@pytest.fixture(scope="module")
def worker_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv of another Python with ``loopgate[worker]`` installed (not editable: a copy)."""
    root = tmp_path_factory.mktemp("worker-venv") / "venv"
    subprocess.run([other_python(), "-m", "venv", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    out = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", f"{REPO}[worker]"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return python


@pytest.mark.timeout(420)
def test_worker_in_another_python_with_only_the_worker_extra_collects_through_the_gateway(
    tmp_path, worker_venv
):
    probe = (
        "import importlib.util, json, sys; print(json.dumps({'version': '%d.%d' % sys.version_info[:2], "
        "'have': {m: importlib.util.find_spec(m) is not None for m in "
        "('numpy', 'zmq', 'msgspec', 'msgpack', 'yaml', 'mujoco', 'torch', 'rich', 'gymnasium', 'prometheus_client')}}))"
    )
    facts = json.loads(
        subprocess.run(
            [str(worker_venv), "-c", probe], capture_output=True, text=True, timeout=60, cwd=tmp_path
        ).stdout
    )
    assert facts["have"] == {
        "numpy": True,
        "zmq": True,
        "msgspec": True,
        "msgpack": False,
        "yaml": True,
        "mujoco": False,
        "torch": False,
        "rich": False,
        "gymnasium": False,
        "prometheus_client": False,
    }, facts
    entry = subprocess.run(
        [str(worker_venv.parent / "loopgate"), "worker", "--help"], capture_output=True, text=True, timeout=60
    )
    assert entry.returncode == 0 and "loopgate worker --connect" in entry.stdout, entry.stderr[-2000:]
    run = tmp_path / "run"
    out = loopgate(
        "up", str(config(tmp_path, str(worker_venv))), "--run-dir", str(run), "--max-env-steps", "200",
        timeout=time_left(),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["outcome"] == "completed" and summary["env_steps"] >= 200
    assert summary["stored_steps"] == summary["acked_steps"] == summary["env_steps"]
    assert summary["lost_steps"] == 0 and summary["duplicate_steps"] == 0
    assert summary["completed_episodes"] >= 4
    worker_log = (run / "logs" / "worker-0.log").read_text()
    assert f"on Python {facts['version']}." in worker_log and str(worker_venv) in worker_log, worker_log[
        -2000:
    ]


@pytest.mark.timeout(120)
def test_env_python_that_does_not_exist_is_a_config_error(tmp_path):
    missing = tmp_path / "nowhere" / "bin" / "python"
    out = loopgate(
        "up", str(config(tmp_path, str(missing))), "--run-dir", str(tmp_path / "run"), timeout=time_left()
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"env.python: {missing} does not exist" in out.stderr
    assert not (tmp_path / "run" / "endpoints.json").exists()  # nothing started


@pytest.mark.timeout(120)
def test_env_python_without_loopgate_is_a_config_error_naming_the_worker_extra(tmp_path):
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=60)
    python = bare / "bin" / "python"
    out = loopgate(
        "up", str(config(tmp_path, str(python))), "--run-dir", str(tmp_path / "run"), timeout=time_left()
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"env.python: {python} cannot import loopgate's worker" in out.stderr
    assert "No module named 'gateway'" in out.stderr and "[worker]" in out.stderr
