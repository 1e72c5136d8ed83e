"""A service's scheduling priority: its niceness (and its session's), and the e-stop path's real-time priority.

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

The control loop's hub and the e-stop's path run at a real-time priority where the
system allows it (:func:`go_realtime`, ``run.realtime_priority``): every thread of the
gateway, and the console's event loop with its ZeroMQ I/O threads. A ``SCHED_FIFO``
thread runs as soon as it is woken, ahead of every normal thread, so on cores saturated
by simulators, camera rendering, browsers or the trainer neither an e-stop nor an action
waits its turn at each hop. The whole gateway, not only its e-stop thread: that thread
needs the GIL, and a loop preempted while holding it would hold the e-stop up too. These
threads sleep until a message comes and do little per message; the kernel's real-time
budget (:func:`realtime_budget`, ``/proc/sys/kernel/sched_rt_runtime_us``) still leaves
normal threads their share should one of them spin, by stopping every real-time thread
of a core for the rest of a second once they have had 950 ms of it. Long background
work beside them therefore runs at normal priority (:func:`leave_realtime`)::

    go_realtime(10, "gateway", every_thread=True)   # True where it took
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import resource
import threading
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

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


def may_use_realtime(priority: int) -> bool:
    """Whether this process may run threads at ``SCHED_FIFO`` ``priority``: within
    ``RLIMIT_RTPRIO`` (``limits.conf``'s ``rtprio``, as real-time ROS 2 setups grant) or
    with ``CAP_SYS_NICE``."""
    soft, _ = resource.getrlimit(resource.RLIMIT_RTPRIO)
    return soft == resource.RLIM_INFINITY or soft >= priority or has_sys_nice()


def threads_named(prefix: str) -> list[int]:
    """Thread ids of this process whose name (``/proc/self/task/<tid>/comm``) starts with ``prefix``."""
    found = []
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            if Path(f"/proc/self/task/{tid}/comm").read_text().startswith(prefix):
                found.append(int(tid))
    return sorted(found)


def zmq_io_threads() -> list[int]:
    """Thread ids of this process's ZeroMQ I/O threads (libzmq names them ``ZMQbg/IO/<n>``;
    a context given a ``THREAD_NAME_PREFIX`` puts ``<prefix>/`` before that, and its
    threads are not among these)."""
    return threads_named("ZMQbg/IO")


def go_realtime(priority: int, what: str, *, every_thread: bool = False, io_above: bool = True) -> bool:
    """Run the calling thread and this process's ZeroMQ I/O threads (``every_thread``: every
    thread of the process) at ``SCHED_FIFO`` ``priority``, the I/O threads one above it
    (where allowed; ``io_above=False``: at it); whether it took (``0``: leave them as they
    are). One above suits a loop that sends one message and goes on with other work (the
    gateway's ACTION, then its bookkeeping): the message leaves at once. At the same
    priority the I/O thread runs once the loop waits, which suits a loop that sends many
    messages in a row (an inference server answering a batch): they leave together,
    instead of the I/O thread taking the core back at every one of them. Threads started
    later inherit the priority of the thread that starts them, a context's I/O thread
    included (it starts with the context's first socket). Where real-time scheduling is
    not allowed this logs once what would allow it and changes nothing."""
    if priority <= 0:
        return False
    if not may_use_realtime(priority):
        log.warning(
            "%s runs at normal priority: real-time priority %d needs CAP_SYS_NICE or an rtprio "
            "limit (`@group - rtprio %d` in /etc/security/limits.conf); on saturated cores an "
            "e-stop or an action may then wait for a core at each hop",
            what,
            priority,
            priority,
        )
        return False
    param = os.sched_param(priority)
    io_threads = zmq_io_threads()
    others = [int(t) for t in os.listdir("/proc/self/task")] if every_thread else io_threads
    # One step above the rest: a message handed to ZeroMQ leaves at once, while the thread
    # that sent it keeps the core for what it does next (the gateway's bookkeeping after
    # an ACTION); at the same priority the send would wait for that thread to block.
    io_priority = min(priority + int(io_above), os.sched_get_priority_max(os.SCHED_FIFO))
    io_param = os.sched_param(io_priority if may_use_realtime(io_priority) else priority)
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, param)
        for tid in others:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setscheduler(tid, os.SCHED_FIFO, io_param if tid in io_threads else param)
    except OSError as exc:  # a container's seccomp or cgroup may refuse what the limits allow
        log.warning("%s: real-time priority %d refused (%s); it runs at normal priority", what, priority, exc)
        return False
    log.info("%s at real-time priority %d (SCHED_FIFO), %d thread(s)", what, priority, len(set(others)) or 1)
    return True


def realtime_budget(kernel: Path = Path("/proc/sys/kernel")) -> tuple[int, int] | None:
    """The kernel's real-time budget, ``(runtime_us, period_us)``: the real-time threads of
    a core may run ``runtime_us`` of every ``period_us``, then all of them wait for the
    period's end (``runtime_us`` -1: no limit); None where the kernel does not say."""
    try:
        runtime = int((kernel / "sched_rt_runtime_us").read_text())
        period = int((kernel / "sched_rt_period_us").read_text())
    except (OSError, ValueError):
        return None
    return runtime, period


def describe_realtime_budget(budget: tuple[int, int] | None) -> str:
    """``realtime_budget()`` in words, for ``loopgate doctor``."""
    if budget is None:
        return "real-time budget unknown"
    runtime, period = budget
    if runtime < 0:
        return "real-time budget unlimited (kernel.sched_rt_runtime_us -1)"
    return (
        f"real-time budget {runtime / 1e3:g} ms of each {period / 1e3:g} ms per CPU "
        f"(a CPU kept busy by real-time threads stops them {(period - runtime) / 1e3:g} ms each period)"
    )


def step_below(what: str, threads: Sequence[int]) -> bool:
    """Run ``threads`` one ``SCHED_FIFO`` priority below the calling thread (under normal
    scheduling where it is at the lowest real-time priority already); whether anything
    changed (nothing where the calling thread is not real-time). For threads that move
    bulk data beside the threads that answer requests (an inference server's weights
    socket's I/O thread, reading tens of megabytes a publication): the answering threads
    preempt them whenever woken, and they still preempt every normal-priority process, so
    a transfer to an idle server goes as fast as at the answering threads' priority. Their
    time counts against the kernel's real-time budget (:func:`realtime_budget`): fit for
    bounded work such as a transfer's copying, not for long computation beside a busy
    server (the loader's builds: :func:`leave_realtime`)."""
    if os.sched_getscheduler(0) != os.SCHED_FIFO:
        return False
    priority = os.sched_getparam(0).sched_priority - 1
    policy = os.SCHED_FIFO if priority >= os.sched_get_priority_min(os.SCHED_FIFO) else os.SCHED_OTHER
    param = os.sched_param(priority if policy == os.SCHED_FIFO else 0)
    try:
        for tid in threads:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setscheduler(tid, policy, param)
    except OSError as exc:
        log.warning("%s stays at real-time priority %d: %s", what, priority + 1, exc)
        return False
    if policy == os.SCHED_FIFO:
        log.info("%s at real-time priority %d, below the threads that serve", what, priority)
    else:
        log.info("%s at normal priority, below the threads that serve", what)
    return True


def leave_realtime(what: str) -> bool:
    """Run the calling thread under normal scheduling (``SCHED_OTHER``) while the rest of its
    process stays real-time (a thread inherits its starter's policy); whether it changed
    anything. For a thread doing long background work beside threads that answer
    requests (an inference server's loader building a new version): they preempt it
    whenever they are woken, and its CPU time does not count against the kernel's
    real-time budget. Kept real-time at any priority, it would: on a core the serving
    threads keep busy, its work pushes the core's real-time time past
    ``kernel.sched_rt_runtime_us`` (950 ms of every second by default), and the kernel then
    stops every real-time thread on that core for the rest of the second, about 50 ms
    with no answers. The price: a serving thread that wants the interpreter lock while
    this thread holds it waits until this thread gets the core among the normal-priority
    processes there. Fit for threads whose holds are short (the loader: onnxruntime
    builds a session holding it at most ~2 ms at a time, numpy's checks and copies not
    at all), not for one that holds it long."""
    if os.sched_getscheduler(0) != os.SCHED_FIFO:
        return False
    priority = os.sched_getparam(0).sched_priority
    try:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except OSError as exc:
        log.warning("%s stays at real-time priority %d: %s", what, priority, exc)
        return False
    log.info("%s at normal priority, below the real-time threads that serve (%d)", what, priority)
    return True


_REALTIME = (os.SCHED_FIFO, os.SCHED_RR)


class RealtimeGuard:
    """Puts back what a library did to this process's threads' scheduling.

    SVT-AV1 (the AV1 encoder LeRobot's datasets use), run with the right to real-time
    scheduling (root, as in most containers), puts the thread that opens an encoder and
    every thread it starts under ``SCHED_FIFO`` at priority 99, the highest there is:
    above the gateway and the e-stop's path (``run.realtime_priority``). A video export
    on a robot's machine would then take the cores from the control loop for 950 ms of
    every second. Made before the library is called, :meth:`restore` (called after each
    call into it) returns every thread it finds under a real-time policy it did not have
    then to the scheduling it had (a new thread: normal scheduling)::

        guard = RealtimeGuard("the AV1 encoder")
        packets = stream.encode(frame)
        guard.restore()
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.before = self._schedules()
        self.restored = 0
        """Threads put back so far."""

    @staticmethod
    def _schedules() -> dict[int, tuple[int, int]]:
        found = {}
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):  # the thread ended meanwhile
                found[int(tid)] = (
                    os.sched_getscheduler(int(tid)),
                    os.sched_getparam(int(tid)).sched_priority,
                )
        return found

    def restore(self) -> int:
        """Put back every thread now real-time that was not (or not so) before; how many."""
        changed: list[tuple[int, int]] = []
        for tid in map(int, os.listdir("/proc/self/task")):
            try:
                policy = os.sched_getscheduler(tid)
                if policy not in _REALTIME:
                    continue
                now = (policy, os.sched_getparam(tid).sched_priority)
                was = self.before.get(tid, (os.SCHED_OTHER, 0))
                if now != was:
                    if tid == threading.get_native_id():
                        _set_own_scheduling(*was)
                    else:
                        os.sched_setscheduler(tid, was[0], os.sched_param(was[1]))
                    changed.append(now)
            except OSError:  # the thread ended meanwhile
                continue
        if changed and not self.restored:
            log.info(
                "%s put %d thread(s) of this process at real-time priority %s; they are back as they were",
                self.what,
                len(changed),
                "/".join(str(p) for p in sorted({p for _, p in changed})),
            )
        self.restored += len(changed)
        return len(changed)


def _set_own_scheduling(policy: int, priority: int) -> None:
    """The calling thread's scheduling, set through the C library as well as the kernel.

    A library that set it with ``pthread_setschedparam`` (SVT-AV1 does) leaves the C
    library's copy of it in the thread's descriptor; ``os.sched_setscheduler`` changes the
    kernel's only. ``pthread_getschedparam`` then still answers the library's policy, and
    libzmq, which reads it in each I/O thread it starts and sets it again, would start
    every later ZeroMQ context's threads at ``SCHED_FIFO`` 99."""
    libc = ctypes.CDLL(None, use_errno=True)
    param = ctypes.c_int(priority)  # struct sched_param: one int
    code = libc.pthread_setschedparam(ctypes.c_ulong(threading.get_ident()), policy, ctypes.byref(param))
    if code:
        raise OSError(code, os.strerror(code))
