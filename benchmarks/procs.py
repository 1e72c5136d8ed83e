"""Processes for benchmarks: CPU placement, start, stop, and always clean up.

On a small shared machine where two processes run changes a round trip by up to 2x
(sharing a core or not), so every measured process is started on an explicit CPU set
and a figure is only ever compared with a baseline started on the same sets::

    server_cpus, client_cpus = split_placement()
    with Processes(tmp) as procs:
        gw = procs.spawn("gateway", [sys.executable, "-m", "gateway.hub", ...], cpus=server_cpus)
        ...
    # every process started here is stopped (SIGTERM, then SIGKILL) when the block ends

Children inherit the CPU set of the thread that starts them, so :meth:`Processes.spawn`
pins the calling thread for the instant of the fork and restores it afterwards.

Every process a benchmark starts ends when ``loopgate bench`` dies, however it dies
(:func:`tied`): a benchmark killed outright must not leave gateways, workers and clients
spinning on the machine's cores.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from gateway import lifeline

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]


def tied(env: dict[str, str] | None = None) -> dict[str, Any]:
    """``subprocess.Popen`` arguments for a child that ends with this process: the kernel's
    SIGTERM when this process dies (``PR_SET_PDEATHSIG``; loopgate's own services then
    stop gracefully), and ``LOOPGATE_LIFELINE`` in its environment (``env``, default this
    process's), so that a loopgate service arms its lifeline and its children go with it."""
    return {
        "preexec_fn": lifeline.die_with_parent,
        "env": {**(os.environ if env is None else env), **lifeline.child_env()},
    }


def code_version(root: Path = REPO) -> str:
    """Which code a run measures: the checkout ``root`` and its commit, and whether files
    differ from it. Benchmarks compare versions; with one environment serving several
    checkouts, the package imported is not always the one in the working directory."""

    def git(*args: str) -> str:
        run = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=True
        )
        return run.stdout.strip()

    try:
        head = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return f"{root} (not a git checkout)"
    return f"{root} at {head}" + (" with uncommitted changes" if dirty else "")


def available_cpus() -> list[int]:
    """CPUs this process may run on, in order."""
    return sorted(os.sched_getaffinity(0))


def split_placement() -> tuple[set[int], set[int]]:
    """(server CPUs, client CPUs): one core each when there are two, else both on one."""
    cpus = available_cpus()
    if len(cpus) >= 2:
        return {cpus[0]}, {cpus[1]}
    return {cpus[0]}, {cpus[0]}


def describe_cpus(cpus: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


@contextlib.contextmanager
def pinned(cpus: set[int] | None) -> Iterator[None]:
    """Pin the calling thread to ``cpus`` for the duration of the block (None: no-op)."""
    if cpus is None:
        yield
        return
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


class Processes:
    """Subprocesses of one measurement, stopped when the ``with`` block ends."""

    def __init__(self, log_dir: str | Path) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        *,
        cpus: set[int] | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` (output to ``<log_dir>/<name>.log``) on ``cpus``."""
        if name in self.procs:
            raise ValueError(f"a process named {name!r} was started already")
        with open(self.log_dir / f"{name}.log", "wb") as out, pinned(cpus):
            proc = subprocess.Popen(
                list(argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                start_new_session=True,  # its own group: stop() reaches its children too
                **tied({**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}),
            )
        self.procs[name] = proc
        log.debug("started %s (pid %d) on cpus %s", name, proc.pid, cpus)
        return proc

    def python(
        self, name: str, module: str, *args: str, cpus: set[int] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``python -m module args`` with this interpreter."""
        return self.spawn(name, [sys.executable, "-m", module, *args], cpus=cpus)

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.log_dir / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def wait(self, name: str, timeout_s: float) -> int:
        """Wait for ``name`` to exit; raise ``RuntimeError`` (with its log) if it fails or hangs."""
        proc = self.procs[name]
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop(name)
            raise RuntimeError(
                f"{name} did not finish within {timeout_s:.0f} s; its log ends:\n{self.log_tail(name)}"
            ) from None
        if code != 0:
            raise RuntimeError(f"{name} exited with {code}; its log ends:\n{self.log_tail(name)}")
        return code

    def check_alive(self, *names: str) -> None:
        for name in names or tuple(self.procs):
            code = self.procs[name].poll()
            if code is not None:
                raise RuntimeError(f"{name} exited early with {code}; its log ends:\n{self.log_tail(name)}")

    def stop(self, name: str, timeout_s: float = 5.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``timeout_s``."""
        proc = self.procs[name]
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s; killing it", name, timeout_s)
        # Kill the whole group even when the leader exited: it may have left children.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def stop_all(self) -> None:
        for name in reversed(list(self.procs)):
            self.stop(name)

    def __enter__(self) -> Processes:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop_all()
