"""Services as Ray actors: one actor per process, the process its own child.

Imported only by :mod:`gateway.engines.ray_engine` (so only with ``run.engine: ray``).
A :class:`ServiceHost` actor is placed by Ray on a node that has what the service
reserves; it starts the service's command there as a child process (its own session,
its own ZeroMQ sockets: Ray never carries data), reports its pid and exit status, and
forwards signals. Its child arms its lifeline (:mod:`gateway.lifeline`) against the
actor, so a dying actor takes the service with it, whatever kills it.

The driver side holds handles that look like :class:`subprocess.Popen` to the
supervisor (``poll``, ``pid``, ``send_signal``, ``wait``, ``kill``), so restarts,
backoff and the stop order stay the supervisor's own:

- :class:`RayProcess`: one service. Until Ray has placed the actor, ``poll()`` is
  ``None`` and :attr:`RayProcess.state` is ``placing`` (a robot's worker waits here for
  its host to come back); when the actor dies with its node, ``poll()`` returns
  ``-SIGKILL`` and the supervisor restarts the service, which Ray places on another node
  that fits.
- :class:`~gateway.engines.ray_ranks.RankGroup`: the trainer's ranks, in their own module.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayError

from gateway import lifeline
from gateway.priority import set_session_niceness

log = logging.getLogger("loopgate.ray")

LOST = -int(signal.SIGKILL)
"""The exit status of a service whose actor (or node) died under it."""
RELEASE_TIMEOUT_S = 5.0
UNAVAILABLE_GRACE_S = 60.0
"""How long an actor Ray calls *unavailable* (its connection lost, its node not yet declared
dead) may stay so before its service is counted lost anyway: past Ray's default node
health check (30 s) with room to spare."""
NODE_CHECK_S = 0.5
"""How often an unavailable actor's node is looked up in Ray's node table."""


@ray.remote(max_restarts=0, max_concurrency=4)  # type: ignore[call-overload]
class ServiceHost:
    """Runs one service's process on the node Ray placed this actor on."""

    def __init__(self) -> None:
        self.child: subprocess.Popen[bytes] | None = None
        self.started = threading.Event()

    def node(self) -> dict[str, Any]:
        """Where this actor runs: node id, IP, host name and the GPUs Ray gave it."""
        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(),
            "ip": ray.util.get_node_ip_address(),  # type: ignore[no-untyped-call]
            "hostname": socket.gethostname(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
        }

    def free_port(self) -> int:
        """A TCP port free on this node now (for the trainer's rendezvous)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def start(
        self, argv: list[str], env: dict[str, str], log_path: str, cwd: str, niceness: int
    ) -> tuple[int, int]:
        """Start the service; its pid and the niceness it runs at. Output goes to
        ``log_path`` (the run folder's log)."""
        child_env = dict(os.environ)
        if "OMP_NUM_THREADS" not in env:
            # Ray pins its workers to one thread; the service decides its own, as under `up`.
            child_env.pop("OMP_NUM_THREADS", None)
        child_env.update(env)

        def prepare_child() -> None:  # in the child, before exec
            lifeline.die_with_parent()
            # Ray runs its workers at niceness 15 (RAY_worker_niceness); the service runs
            # at run.nice's, as under the local engine, where the node allows it.
            with contextlib.suppress(PermissionError, OSError):
                os.setpriority(os.PRIO_PROCESS, 0, niceness)
            set_session_niceness(os.getpriority(os.PRIO_PROCESS, 0))  # see gateway.priority

        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        with open(log_path, "ab") as out:
            self.child = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=child_env,
                start_new_session=True,
                cwd=cwd if os.path.isdir(cwd) else None,
                preexec_fn=prepare_child,
            )
        self.started.set()
        try:
            nice = os.getpriority(os.PRIO_PROCESS, self.child.pid)
        except OSError:  # already gone: its exit is reported by wait()
            nice = niceness
        return int(self.child.pid), int(nice)

    def wait(self) -> int:
        """Block until the service exits; its exit status (negative: killed by that signal)."""
        self.started.wait()
        assert self.child is not None
        code = self.child.wait()
        # Whatever it left in its session goes with it, before anything restarts.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.child.pid, signal.SIGKILL)
        return int(code)

    def signal(self, sig: int) -> None:
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL the service and everything in its session."""
        if self.child is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.child.pid, signal.SIGKILL)


def ref_ready(ref: Any) -> bool:
    done, _ = ray.wait([ref], timeout=0)
    return bool(done)


class RayProcess:
    """One service on a :class:`ServiceHost` actor, as the supervisor sees a process."""

    def __init__(
        self,
        name: str,
        options: dict[str, Any],
        argv: list[str],
        env: dict[str, str],
        log_path: str,
        *,
        niceness: int = 0,
        on_placed: Callable[[dict[str, Any]], None] | None = None,
        autostart: bool = True,
    ) -> None:
        self.name, self.argv, self.env, self.log_path = name, argv, env, log_path
        self.niceness, self.on_placed, self.autostart = niceness, on_placed, autostart
        self.actor = ServiceHost.options(**options).remote()  # type: ignore[attr-defined]
        self._node_ref = self.actor.node.remote()
        self._start_ref: Any = None
        self._exit_ref: Any = None
        self.node: dict[str, Any] | None = None
        self.pid: int | None = None
        self.returncode: int | None = None
        self.stopping = False
        self.waiting_since = time.monotonic()
        self._waiting_logged = False
        self.unavailable_since: float | None = None
        """When Ray first said the actor was unavailable (None: it answers)."""
        self._node_checked = 0.0
        self._probe_ref: Any = None
        self._killed = False
        """The actor reported its service killed outright and is asked once more (:meth:`poll`)."""

    @property
    def state(self) -> str:
        if self.returncode is not None:
            return "exited"
        if self.node is None:
            return "placing"
        return "starting" if self.pid is None else "running"

    def describe_node(self) -> str:
        return "" if self.node is None else f"node {self.node['ip']} {self.node['node_id'][:8]}"

    def placed(self) -> bool:
        """Whether Ray has placed the actor (its node known); advances the state."""
        self.poll()
        return self.node is not None

    def launch(self, extra_env: dict[str, str] | None = None) -> None:
        """Start the service on the placed actor (done by ``poll`` unless ``autostart=False``)."""
        env = {**self.env, **(extra_env or {})}
        self._start_ref = self.actor.start.remote(self.argv, env, self.log_path, os.getcwd(), self.niceness)
        self._exit_ref = self.actor.wait.remote()

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        try:
            if self.node is None:
                if not ref_ready(self._node_ref):
                    self._log_waiting()
                    return None
                self.node = ray.get(self._node_ref)
                log.info("%s placed on %s (%s)", self.name, self.node["ip"], self.node["node_id"][:12])
                if self.stopping:
                    return self._end(-int(signal.SIGTERM))
                if self.on_placed is not None:
                    self.on_placed(self.node)
                if self.autostart:
                    self.launch()
                return None
            if self._start_ref is None:
                return None
            if self.pid is None:
                if not ref_ready(self._start_ref):
                    return None
                pid, nice = ray.get(self._start_ref)
                self.pid = int(pid)
                if nice != self.niceness:
                    log.warning(
                        "%s runs at niceness %d instead of %d: start the node's Ray with "
                        "RAY_worker_niceness=0 (or allow raising priority)",
                        self.name,
                        nice,
                        self.niceness,
                    )
            if self.unavailable_since is not None:
                if not self._still_unavailable():
                    return self._end(LOST)
                if not ref_ready(self._probe_ref):
                    return None  # nothing to learn from the actor until it answers
                ray.get(self._probe_ref)  # raises while it is still unavailable
                if self._killed:
                    return self._end(LOST)  # the actor answers: its node is alive, the kill stands
                log.info("%s: its Ray actor answers again", self.name)
                self.unavailable_since = None
                self._exit_ref = self.actor.wait.remote()  # the one asked before failed
            if not ref_ready(self._exit_ref):
                return None
            code = int(ray.get(self._exit_ref))
            if code == LOST and not self._killed:
                # A Ray worker SIGKILLs its children on its way out when its node is lost,
                # and that report can arrive before Ray declares the node dead; counted
                # lost then, the service would be placed again on a view that still holds
                # the lost node. The actor is asked once more, as when it does not answer:
                # an answer confirms the kill (an OOM kill, a ``kill -9``), Ray's verdict on
                # its node or the grace decides otherwise.
                log.info(
                    "%s was killed (SIGKILL); waiting for its Ray actor to answer before restarting it",
                    self.name,
                )
                self._killed = True
                self.unavailable_since = time.monotonic()
                self._probe_ref = self.actor.node.remote()
                return None
            return self._end(code)
        except ActorUnavailableError as exc:
            return self._unavailable(exc)
        except RayError as exc:
            log.warning("%s: its Ray actor is gone (%s); counting it as killed", self.name, first_line(exc))
            return self._end(LOST)

    def _unavailable(self, exc: ActorUnavailableError) -> int | None:
        """Ray lost the connection to the actor but has not declared it dead. Its node may
        only be slow to answer (the service then still runs, and a second copy must not
        start), or gone and not yet declared dead: a replacement placed now would be
        scheduled on a view that still counts the lost node's room, and Ray can wait on
        that node indefinitely. So the service counts as lost once Ray declares its node
        dead (or the actor dead), or after :data:`UNAVAILABLE_GRACE_S`; meanwhile a probe
        asks the actor where it runs, and once it answers its exit is awaited again."""
        now = time.monotonic()
        if self.unavailable_since is None:
            self.unavailable_since = now
            log.warning(
                "%s: its Ray actor does not answer (%s); waiting up to %.0f s for Ray to declare "
                "its node dead before restarting it",
                self.name,
                first_line(exc),
                UNAVAILABLE_GRACE_S,
            )
        if not self._still_unavailable():
            return self._end(LOST)
        if self.pid is not None:
            self._probe_ref = self.actor.node.remote()  # answers once the actor does
        return None

    def _still_unavailable(self) -> bool:
        """Whether an unavailable actor may still come back: its node alive in Ray's node
        table (looked up every :data:`NODE_CHECK_S`) and the grace not spent."""
        assert self.unavailable_since is not None
        now = time.monotonic()
        if now - self.unavailable_since >= UNAVAILABLE_GRACE_S:
            log.warning(
                "%s: its Ray actor did not answer for %.0f s; counting it as killed",
                self.name,
                now - self.unavailable_since,
            )
            return False
        if now - self._node_checked < NODE_CHECK_S:
            return True
        self._node_checked = now
        node_id = self.node["node_id"] if self.node else None
        alive = any(n.get("NodeID") == node_id and n.get("Alive") for n in ray.nodes())  # type: ignore[no-untyped-call]
        if not alive:
            log.warning("%s: Ray declared its node dead; counting it as killed", self.name)
        return alive

    def _log_waiting(self) -> None:
        waited = time.monotonic() - self.waiting_since
        if waited > 10.0 and not self._waiting_logged:
            self._waiting_logged = True
            log.warning(
                "%s waits for a node with what it needs (%.0f s so far): see run.placement", self.name, waited
            )

    def _end(self, code: int) -> int:
        self.returncode = code
        return code

    def send_signal(self, sig: int) -> None:
        self.stopping = True
        if self.pid is not None and self.returncode is None:
            self.actor.signal.remote(int(sig))

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.stopping = True
        if self.returncode is None:
            self.actor.kill.remote()
            if self.pid is None:  # never started: nothing will report an exit
                self._end(LOST)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            code = self.poll()
            if code is not None:
                return code
            if self.pid is None and self.stopping:
                return self._end(-int(signal.SIGTERM))  # placed or not, it never ran
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.name, timeout or 0.0)
            time.sleep(0.05)

    def release(self) -> None:
        """Kill the service's session (if it still runs) and the actor, freeing its resources."""
        with contextlib.suppress(RayError, GetTimeoutError):
            if self.pid is not None:
                ray.get(self.actor.kill.remote(), timeout=RELEASE_TIMEOUT_S)
        with contextlib.suppress(RayError, ValueError):
            ray.kill(self.actor, no_restart=True)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__
