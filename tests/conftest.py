"""Shared fixtures: real processes on loopback, run folders, and clean teardown.

Processes started through :func:`spawn` are killed at the end of the test whatever
happens; every wait has a deadline and fails the test instead of hanging.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]

_test_deadline: list[float] = [float("inf")]
"""When pytest-timeout stops the running test (monotonic time)."""


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("timeout")
    limit = marker.args[0] if marker and marker.args else item.config.getini("timeout")
    _test_deadline[0] = time.monotonic() + float(limit) if limit else float("inf")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``--dist loadgroup`` (``make test``): whole experiments (e2e) form one group,
    run one after another on one worker, first, while the other layers share the rest."""
    if getattr(config.option, "dist", "no") != "loadgroup":
        return
    e2e = [item for item in items if item.get_closest_marker("e2e")]
    for item in e2e:
        item.add_marker(pytest.mark.xdist_group("e2e"))
    items[:] = e2e + [item for item in items if not item.get_closest_marker("e2e")]


def time_left(margin: float = 20.0) -> float:
    """Seconds until pytest-timeout would stop this test, less ``margin`` for teardown:
    the deadline a test's own waits use, so that they fail first, with their message."""
    return max(1.0, _test_deadline[0] - time.monotonic() - margin)


def wait_for(
    predicate: Callable[[], Any],
    timeout: float | None = None,
    interval: float = 0.05,
    what: str = "condition",
) -> Any:
    """``predicate()`` once it is true, polled every ``interval`` s; an ``AssertionError``
    naming ``what`` after ``timeout`` s, by default the test's time left (:func:`time_left`):
    on a machine busy with other work a wait takes what it takes, and still fails with its
    own message before pytest-timeout stops the test."""
    if timeout is None:
        timeout = time_left()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def sigint_at_default() -> None:
    """A ``preexec_fn``: the child starts with SIGINT at its default, as in a terminal's
    foreground. A background job (a CI runner may be one) starts with SIGINT ignored, and
    its children with it, where Ctrl-C never reaches a command that sets no handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt_when(
    proc: subprocess.Popen[Any],
    ready: Callable[[], Any],
    *,
    what: str,
    timeout: float,
    within: float | None = None,
    interval: float = 0.05,
) -> Any:
    """Ctrl-C to ``proc`` once ``ready()`` (waited for up to ``timeout`` s); its output (None
    unless piped), once it ended within ``within`` s (default: the test's time left). It is
    killed if anything fails."""
    try:
        wait_for(ready, timeout=timeout, interval=interval, what=what)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=time_left() if within is None else within)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    return out


def loopgate(
    *args: str, timeout: float = 180, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the ``loopgate`` CLI with this interpreter to completion; its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=None if env is None else {**os.environ, **env},
    )


def _die_with_parent() -> None:
    """In the child: be killed when the test process dies, even if it is killed outright."""
    import ctypes

    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Procs:
    """Subprocesses of one test, killed at teardown."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(
        self, *args: str, name: str = "proc", env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}-{len(self.procs)}.log", "wb")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen(
            [sys.executable, *args],
            preexec_fn=_die_with_parent,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
        )
        log.close()
        proc.log_path = Path(log.name)  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.kill_all()


def log_of(proc: subprocess.Popen[bytes]) -> str:
    return Path(proc.log_path).read_text(errors="replace")  # type: ignore[attr-defined]


def write_config(path: Path, **blocks: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(blocks))
    return path


class GatewayRun:
    """A real gateway process on a run folder, plus helpers to start workers."""

    def __init__(self, procs: Procs, run_dir: Path, config: Path, extra: tuple[str, ...] = ()) -> None:
        self.procs, self.run_dir, self.config, self.extra = procs, run_dir, config, extra
        self.proc: subprocess.Popen[bytes] | None = None
        self.control: Any = None

    def start(self) -> GatewayRun:
        from gateway.control_client import ControlClient

        self.proc = self.procs.spawn(
            "-m",
            "gateway.hub",
            "--config",
            str(self.config),
            "--run-dir",
            str(self.run_dir),
            *self.extra,
            name="gateway",
        )
        endpoints = self.run_dir / "endpoints.json"
        wait_for(
            lambda: endpoints.exists() and json.loads(endpoints.read_text()).get("gateway"),
            what="endpoints.json",
        )
        if self.control is None:
            keys = None
            cfg = yaml.safe_load(self.config.read_text())
            if cfg.get("gateway", {}).get("curve_keys"):
                from gateway.transport import CurveKeys

                keys = CurveKeys.load(cfg["gateway"]["curve_keys"])
            self.control = ControlClient(self.endpoints["control"], keys)
        wait_for(self._answers, what="gateway control socket")
        return self

    def _answers(self) -> bool:
        from gateway.protocol import Timeout

        try:
            self.control.request("status", timeout_s=0.5)
            return True
        except Timeout:
            return False

    @property
    def endpoints(self) -> dict[str, str]:
        return json.loads((self.run_dir / "endpoints.json").read_text())["gateway"]

    def status(self) -> dict[str, Any]:
        return self.control.request("status", timeout_s=5.0)

    def worker(self, index: int = 0, *extra: str) -> subprocess.Popen[bytes]:
        return self.procs.spawn(
            "-m",
            "gateway.worker",
            "--config",
            str(self.config),
            "--endpoints",
            str(self.run_dir / "endpoints.json"),
            "--index",
            str(index),
            *extra,
            name="worker",
        )

    def kill(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def drain(self) -> dict[str, Any]:
        self.control.request("pause", timeout_s=5.0)
        return self.control.request("drain", timeout_s=20.0)

    def close(self) -> None:
        if self.control is not None:
            self.control.close()


@pytest.fixture
def gateway_run(procs: Procs, tmp_path: Path) -> Iterator[Callable[..., GatewayRun]]:
    runs: list[GatewayRun] = []

    def make(config: dict[str, Any] | None = None, extra: tuple[str, ...] = ()) -> GatewayRun:
        cfg = config or {"env": {"backend": "mujoco_reach", "num_envs": 4}, "policy": {"kind": "random"}}
        cfg.setdefault("gateway", {}).setdefault("worker_timeout_s", 3.0)
        path = write_config(tmp_path / f"config-{len(runs)}.yaml", **cfg)
        run = GatewayRun(procs, tmp_path / f"run-{len(runs)}", path, extra)
        runs.append(run)
        return run.start()

    try:
        yield make
    finally:
        for run in runs:
            run.close()


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> Any:
    """CUDA replaced by :class:`tests.cuda_standin.CpuStandIn` for this test: CUDA cannot
    run on a machine without a GPU (torch is imported only by tests that ask for this)."""
    from gateway import cuda_ipc
    from tests.cuda_standin import CpuStandIn

    ops = CpuStandIn()
    monkeypatch.setattr(cuda_ipc, "_OPS", ops)
    return ops
