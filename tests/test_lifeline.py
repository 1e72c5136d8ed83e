"""A process's lifeline: it ends when the process that started it dies, told exactly once
where it asks for that (torchrun, whose shutdown a second SIGTERM breaks off).

Real processes: a stand-in supervisor with several threads (as ``loopgate up`` has)
starts a child the way ``loopgate up`` does (``die_with_parent`` as ``preexec_fn``,
``LOOPGATE_LIFELINE=1``) and is then killed with SIGKILL; the child counts the SIGTERMs
it receives.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO, wait_for

pytestmark = pytest.mark.integration

SUPERVISOR = textwrap.dedent(
    """
    import subprocess, sys, threading, time
    from gateway import lifeline

    for _ in range(4):  # threads that outlive the child's start, as the supervisor's do
        threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    child = subprocess.Popen(
        [sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]],
        preexec_fn=lifeline.die_with_parent,
        env={**__import__("os").environ, **lifeline.child_env()},
    )
    print(child.pid, flush=True)
    time.sleep(3600)
    """
)

CHILD = textwrap.dedent(
    """
    import signal, sys, time
    from gateway import lifeline

    out, kernel = sys.argv[1], sys.argv[2] == "kernel"
    heard = []

    def on_term(signum, frame):
        heard.append(signum)
        open(out, "w").write(str(len(heard)))

    signal.signal(signal.SIGTERM, on_term)
    lifeline.arm(30.0, kernel_signal=kernel)
    open(out + ".armed", "w").close()
    while not heard:
        time.sleep(0.05)
    time.sleep(3.0)  # long enough for every further signal the supervisor's end may bring
    open(out, "w").write(str(len(heard)) + " done")
    """
)


def signals_heard_after_the_supervisor_is_killed(tmp_path: Path, mode: str) -> str:
    out = tmp_path / "heard"
    supervisor = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, CHILD, str(out), mode],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    child = int(supervisor.stdout.readline())  # type: ignore[union-attr]
    try:
        wait_for(lambda: Path(f"{out}.armed").exists(), timeout=30, what="the child to arm its lifeline")
        supervisor.kill()
        supervisor.wait(timeout=10)
        wait_for(
            lambda: out.exists() and out.read_text().endswith("done"),
            timeout=30,
            what="the child to hear its supervisor is gone",
        )
        return out.read_text().split()[0]
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def test_a_child_that_asks_for_one_signal_hears_its_supervisors_death_exactly_once(tmp_path):
    assert signals_heard_after_the_supervisor_is_killed(tmp_path, "watcher") == "1"


def test_a_child_with_the_kernels_signal_hears_its_supervisors_death(tmp_path):
    assert int(signals_heard_after_the_supervisor_is_killed(tmp_path, "kernel")) >= 1
