"""Helpers for running ROS 2 robots on one machine without cross-talk: tests and benchmarks.

Every user of ROS 2 here takes a :class:`DomainLease`, a ROS domain id held through a
lock file for as long as it runs, so parallel test runs and benchmarks on one machine
never see each other's topics (an e-stop in one must not stop robots in another)::

    with DomainLease() as domain:
        env = ros_env(domain.id)                       # for child processes
        proc = subprocess.Popen([*emulator_argv(namespace="/arm1"), ...], env={**os.environ, **env})
        backend = make_backend("ros2", num_envs=1, options={"domain_id": domain.id, ...})

Discovery is limited to this host (``ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST``).
Nothing here imports rclpy.
"""

from __future__ import annotations

import fcntl
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

DOMAIN_RANGE = range(101, 232)
"""Domains handed out; 0 (the default) and the low ones people use by hand are left alone."""
LOCK_DIR = Path(tempfile.gettempdir()) / "loopgate-ros-domains"


class DomainLease:
    """An unused ROS domain id, held (by an advisory file lock) until :meth:`release`."""

    def __init__(self) -> None:
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        candidates = list(DOMAIN_RANGE)
        random.SystemRandom().shuffle(candidates)
        for domain in candidates:
            handle: IO[str] = open(LOCK_DIR / f"{domain}.lock", "w")  # noqa: SIM115 - held until release()
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            self.id, self._handle = domain, handle
            return
        raise RuntimeError(f"every ROS domain in {DOMAIN_RANGE} is in use on this machine")

    def release(self) -> None:
        if not self._handle.closed:
            fcntl.flock(self._handle, fcntl.LOCK_UN)
            self._handle.close()

    def __enter__(self) -> DomainLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def ros_env(domain_id: int) -> dict[str, str]:
    """Environment variables for a child process that joins ``domain_id`` on this host only."""
    return {"ROS_DOMAIN_ID": str(domain_id), "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST"}


def emulator_argv(*args: str, namespace: str = "/", record: str | Path | None = None) -> list[str]:
    """The command line of a reach arm emulator process."""
    argv = [sys.executable, "-m", "robots.emulator", "--namespace", namespace, *args]
    if record is not None:
        argv += ["--record", str(record)]
    return argv


def read_record(path: str | Path) -> list[dict[str, Any]]:
    """The entries an emulator wrote with ``--record`` (complete lines only)."""
    path = Path(path)
    if not path.exists():
        return []
    entries = []
    for line in path.read_text().splitlines():
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line still being written
    return entries


def ros2_available() -> str | None:
    """None when rclpy and the message packages import; else why not."""
    try:
        import rclpy  # noqa: F401
        import sensor_msgs.msg  # noqa: F401
        import std_msgs.msg  # noqa: F401
        import trajectory_msgs.msg  # noqa: F401
    except ImportError as exc:
        return f"ROS 2 is not installed ({exc}); pip install -e '.[ros2]' or source a ROS 2 Kilted install"
    return None
