"""Processes of a run end when the process that started them dies, however it dies.

``loopgate up`` starts every service with :func:`die_with_parent` as its ``preexec_fn``
(Linux ``PR_SET_PDEATHSIG``: the kernel sends SIGTERM when the supervisor dies, even by
SIGKILL) and with ``LOOPGATE_LIFELINE=1`` in the environment. Every loopgate service
calls :func:`arm` first thing in its ``main``; with that variable set it does the same
for itself (so grandchildren, such as torchrun's ranks, die with their launcher) and
starts a watcher thread that notices being re-parented and stops the process: first a
SIGTERM to itself (the graceful path every service has), then, if that has not ended
the process within ``grace_s``, an immediate exit::

    def main(argv=None):
        lifeline.arm()
        ...

The kernel sends that signal once for every thread of the parent that exits, so a
multi-threaded supervisor's death may bring several; a process whose shutdown a second
SIGTERM would break off (torchrun: ``trainer/torchrun.py``) arms with
``kernel_signal=False`` and gets exactly one, from the watcher.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time

log = logging.getLogger(__name__)

ENV = "LOOPGATE_LIFELINE"
PR_SET_PDEATHSIG = 1
POLL_S = 0.5
GRACE_S = 15.0


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (another user's counts): files named
    after a process that is gone (a shared-memory segment, an export's partial) are stale."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel for ``sig`` when the parent dies (safe to use as ``preexec_fn``);
    whether it took (Linux only)."""
    try:
        return int(ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))) == 0
    except (OSError, AttributeError):
        return False


def child_env() -> dict[str, str]:
    """Environment entries that make a child (and its children) arm their lifeline."""
    return {ENV: "1"}


def arm(grace_s: float = GRACE_S, *, kernel_signal: bool = True) -> bool:
    """Under a supervisor (``LOOPGATE_LIFELINE=1``): end this process when its parent dies.

    Returns whether the lifeline was armed. A process started by hand is left alone.
    With ``kernel_signal=False`` the kernel's parent-death signal (which comes once per
    exiting thread of the parent, so often more than once) is cleared and the watcher
    sends a single SIGTERM instead, up to :data:`POLL_S` later.
    """
    if os.environ.get(ENV) != "1":
        return False
    parent = os.getppid()
    if kernel_signal:
        kernel = die_with_parent()
    else:
        die_with_parent(0)
        kernel = False
    if os.getppid() != parent or parent == 1:  # the parent died before prctl took effect
        _parent_gone(grace_s, signal_self=True)
        return True
    threading.Thread(target=_watch, args=(parent, grace_s, not kernel), name="lifeline", daemon=True).start()
    return True


def _watch(parent: int, grace_s: float, signal_self: bool) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    _parent_gone(grace_s, signal_self)


def _parent_gone(grace_s: float, signal_self: bool) -> None:
    """Stop gracefully (the kernel's SIGTERM, or ours where it has none), then for sure."""
    log.warning("the process that started this one is gone; stopping (forced in %.0f s)", grace_s)
    timer = threading.Timer(grace_s, os._exit, args=(1,))
    timer.daemon = True
    timer.start()
    if signal_self:
        os.kill(os.getpid(), signal.SIGTERM)
