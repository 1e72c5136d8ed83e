"""``gateway.locks``: one process at a time on a run folder's parts."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from gateway.locks import Locked, hold, wait_to_hold
from tests.conftest import REPO, write_config


@pytest.mark.unit
def test_a_held_lock_is_refused_naming_its_holder_and_free_once_let_go(tmp_path):
    path = tmp_path / "run" / "LOCK"
    fd = hold(path, "first")
    with pytest.raises(Locked, match=rf"{tmp_path / 'run'} is in use by pid {os.getpid()} \(first\)"):
        hold(path, "second")
    os.close(fd)
    os.close(hold(path, "second"))


@pytest.mark.unit
def test_waiting_for_a_lock_ends_when_its_holder_lets_go_or_at_the_deadline(tmp_path):
    path = tmp_path / "LOCK"
    fd = hold(path, "stopping")
    said: list[str] = []
    with pytest.raises(Locked, match=r"in use by pid \d+ \(stopping\), still after 0 s"):
        wait_to_hold(path, "next", 0.2, said.append)
    assert said == [f"waiting up to 0 s for pid {os.getpid()} (stopping) to let go of {tmp_path}"]
    threading.Timer(0.3, os.close, (fd,)).start()
    os.close(wait_to_hold(path, "next", 30.0, said.append))


@pytest.mark.integration
def test_a_gateway_refuses_a_spool_another_gateway_holds(tmp_path):
    """A second gateway on one run folder once recorded into the first one's spool. It
    waits ``stop_drain_s`` + 10 s for a holder that is stopping, then refuses (exit 2)."""
    config = write_config(
        tmp_path / "c.yaml",
        env={"backend": "mujoco_reach", "num_envs": 1},
        gateway={"stop_drain_s": 0},
    )
    fd = hold(tmp_path / "run" / "spool" / "LOCK", "gateway")
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "gateway.hub",
                "--config",
                str(config),
                "--run-dir",
                str(tmp_path / "run"),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        os.close(fd)
    assert out.returncode == 2, out.stderr[-2000:]
    assert (
        f"waiting up to 10 s for pid {os.getpid()} (gateway) to let go of {tmp_path / 'run' / 'spool'}"
        in out.stderr
    )
    assert (
        f"{tmp_path / 'run' / 'spool'} is in use by pid {os.getpid()} (gateway), still after 10 s"
        in out.stderr
    )
    assert not (tmp_path / "run" / "endpoints.json").exists(), "it wrote nothing in the run folder"
