"""One process at a time on a run folder's parts: an advisory ``flock`` held for the
holder's life (the kernel drops it when the process ends, however it ends).

``loopgate up`` holds ``RUN/.loopgate-up.lock``, the gateway ``RUN/spool/LOCK`` and the
replay service ``RUN/replay/LOCK``: a second ``loopgate up`` on a folder in use is refused
before it writes anything there, where it once ran beside the first one, each process
writing the other's spool and store::

    fd = hold(run_dir / UP_LOCK, "loopgate up")   # Locked("... pid 1234 (loopgate up)")
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path

UP_LOCK = ".loopgate-up.lock"
"""The run folder's lock, held by the ``loopgate up`` running on it."""


class Locked(RuntimeError):
    """Another process holds the lock; the message names it (pid, and what it is)."""

    def __init__(self, folder: Path, holder: str) -> None:
        super().__init__(f"{folder} is in use by {holder}")
        self.folder, self.holder = folder, holder


def holder(path: Path) -> str:
    """Who holds the lock at ``path``, as its holder wrote it ("pid N (what)")."""
    try:
        text = path.read_text().strip()
    except OSError:
        return "another process"
    return text or "another process"


def hold(path: Path, what: str) -> int:
    """Hold the lock at ``path`` (created with its folder) for this process's life: the
    file descriptor, not inherited by children; :class:`Locked` if another holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise Locked(path.parent, holder(path)) from None
    try:  # who holds it, for the message of one refused; a full disk leaves it unsaid
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} ({what})\n".encode(), 0)
    except OSError:
        pass
    return fd


def wait_to_hold(path: Path, what: str, timeout_s: float, say: Callable[[str], None]) -> int:
    """:func:`hold`, waiting up to ``timeout_s`` for a holder that is ending (a process
    still stopping); ``say`` hears once what it waits for. :class:`Locked` at the deadline."""
    deadline = time.monotonic() + timeout_s
    said = False
    while True:
        try:
            return hold(path, what)
        except Locked as exc:
            if time.monotonic() >= deadline:
                raise Locked(exc.folder, f"{exc.holder}, still after {timeout_s:.0f} s") from None
            if not said:
                say(f"waiting up to {timeout_s:.0f} s for {exc.holder} to let go of {exc.folder}")
                said = True
        time.sleep(0.1)
