"""A service's scheduling priority: its own niceness, and its session's where the kernel groups sessions.

Every service of a run starts in a session of its own (``start_new_session``). With the
kernel's autogroup scheduling (``CONFIG_SCHED_AUTOGROUP``, on by default in most Linux
distributions; ``/proc/sys/kernel/sched_autogroup_enabled``) the CPU is first shared
fairly between sessions, and a process's niceness weighs only against the other
processes of its own session: a niced service alone in its session would still take as
much CPU as the gateway. :func:`set_session_niceness` gives the session the process's
niceness as well (``/proc/self/autogroup``; the rules of ``setpriority`` apply: anyone
may lower a priority, raising one needs ``CAP_SYS_NICE``)::

    def prepare_child():            # preexec_fn of a service started in its own session
        set_session_niceness(os.nice(10))
"""

from __future__ import annotations

import contextlib
import os
import resource
from pathlib import Path

AUTOGROUP = "/proc/self/autogroup"
CAP_SYS_NICE = 23


def has_sys_nice() -> bool:
    """Whether this process holds ``CAP_SYS_NICE`` (Linux; False where that cannot be read)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_SYS_NICE & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def may_set_niceness(niceness: int) -> bool:
    """Whether a child of this process may run at ``niceness``: a lower priority always,
    a higher one within ``RLIMIT_NICE`` (``limits.conf``'s ``nice``) or with ``CAP_SYS_NICE``."""
    if niceness >= os.getpriority(os.PRIO_PROCESS, 0):
        return True
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or 20 - soft <= niceness or has_sys_nice()


def set_session_niceness(niceness: int) -> bool:
    """Give this process's autogroup ``niceness``; whether it took (safe as ``preexec_fn``).

    False where there is no autogroup to set (another kernel, another OS) or raising the
    priority is not allowed: the process's own niceness is then all there is.
    """
    with contextlib.suppress(OSError), open(AUTOGROUP, "w") as f:
        f.write(str(int(niceness)))
        return True
    return False


def session_niceness(pid: int) -> int | None:
    """The niceness of ``pid``'s autogroup (None: no autogroup to read)."""
    try:
        text = Path(f"/proc/{pid}/autogroup").read_text()  # "/autogroup-71 nice 10"
    except OSError:
        return None
    words = text.split()
    return int(words[-1]) if len(words) >= 3 and words[-2] == "nice" else None
