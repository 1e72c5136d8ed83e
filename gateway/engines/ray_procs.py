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
- :class:`RankGroup`: the trainer's ranks, one actor per bundle of one placement group,
  rendezvous by ``torch.distributed``'s env:// variables (``MASTER_ADDR`` is rank 0's
  node, ``MASTER_PORT`` a port free there): what ``torchrun`` would set. One rank lost
  ends them all and frees the group; the restart gets a new placement group and the
  trainer resumes from its last checkpoint. With several world sizes allowed
  (``trainer.min_nproc``), a group that finds no room within ``trainer.shrink_after_s``
  is given up for one a rank smaller, down to the smallest: the trainer then resumes at
  that size (its DCP checkpoint reshards on load).
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
from collections import Counter
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayError
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

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


def _ready(ref: Any) -> bool:
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
                if not _ready(self._node_ref):
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
                if not _ready(self._start_ref):
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
                if not _ready(self._probe_ref):
                    return None  # nothing to learn from the actor until it answers
                ray.get(self._probe_ref)  # raises while it is still unavailable
                if self._killed:
                    return self._end(LOST)  # the actor answers: its node is alive, the kill stands
                log.info("%s: its Ray actor answers again", self.name)
                self.unavailable_since = None
                self._exit_ref = self.actor.wait.remote()  # the one asked before failed
            if not _ready(self._exit_ref):
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
            log.warning("%s: its Ray actor is gone (%s); counting it as killed", self.name, _first_line(exc))
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
                _first_line(exc),
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


class RankGroup:
    """The trainer's ranks in one placement group, rendezvous through Ray."""

    def __init__(
        self,
        name: str,
        bundles: list[dict[str, float]],
        strategy: str,
        argv: list[str],
        env: dict[str, str],
        log_path: str,
        *,
        niceness: int = 0,
        label_selector: dict[str, str] | None = None,
        on_placed: Callable[[dict[str, Any]], None] | None = None,
        smaller: list[int] | None = None,
        shrink_after_s: float = 30.0,
    ) -> None:
        self.name, self.argv, self.env, self.log_path = name, argv, env, log_path
        self.niceness, self.on_placed = niceness, on_placed
        self.strategy, self.label_selector = strategy, label_selector
        self.smaller = sorted(smaller or [], reverse=True)
        """World sizes to fall back to, largest first, when the group finds no room."""
        if any(not 1 <= n < len(bundles) for n in self.smaller):
            raise ValueError(f"{name}: smaller world sizes must be in [1, {len(bundles) - 1}], got {smaller}")
        self.shrink_after_s = shrink_after_s
        self.pg: PlacementGroup | None = None
        self._pg_checked = 0.0
        self._place(bundles)
        self.ranks: list[RayProcess] = []
        self.launched = False
        self.returncode: int | None = None
        self.stopping = False
        self.waiting_since = time.monotonic()

    def _place(self, bundles: list[dict[str, float]]) -> None:
        """Ask Ray for a placement group of ``bundles`` (one per rank)."""
        self.world_size = len(bundles)
        self._bundles = bundles
        kwargs: dict[str, Any] = {
            "strategy": self.strategy,
            "name": f"loopgate-{self.name}-{os.getpid()}-{time.time_ns()}",
        }
        if self.label_selector:
            kwargs["bundle_label_selector"] = [dict(self.label_selector) for _ in bundles]
        self.pg = placement_group(bundles, **kwargs)
        self._pg_ready = self.pg.ready()
        self.placing_since = time.monotonic()

    def _shrink(self) -> None:
        """No room for this group for ``shrink_after_s``: give it up for one of the next
        smaller world size."""
        size = self.smaller.pop(0)
        log.warning(
            "%s: no room for %d ranks within %.0f s; asking for %d instead (trainer.min_nproc), "
            "the trainer resumes from its last checkpoint at that size",
            self.name,
            self.world_size,
            self.shrink_after_s,
            size,
        )
        if self.pg is not None:
            with contextlib.suppress(RayError, ValueError):
                remove_placement_group(self.pg)
        self._place(self._bundles[:size])

    @property
    def pid(self) -> int | None:
        return self.ranks[0].pid if self.launched and self.ranks else None

    @property
    def state(self) -> str:
        if self.returncode is not None:
            return "exited"
        if not self.launched:
            return "placing"
        return "running" if all(r.pid is not None for r in self.ranks) else "starting"

    def describe_node(self) -> str:
        nodes = sorted({r.node["ip"] + " " + r.node["node_id"][:8] for r in self.ranks if r.node})
        return f"{self.world_size} ranks on " + ", ".join(nodes) if nodes else ""

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        try:
            if not self.ranks:
                if not _ready(self._pg_ready):
                    if self.smaller and time.monotonic() - self.placing_since >= self.shrink_after_s:
                        self._shrink()
                    return None
                if self.stopping:
                    return self._end(-int(signal.SIGTERM))
                assert self.pg is not None
                self.ranks = [
                    RayProcess(
                        f"{self.name}[{rank}]",
                        {
                            "num_cpus": 0,
                            "scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, rank),
                            **self._bundle_options(rank),
                        },
                        self.argv,
                        self.env,
                        self.log_path,
                        niceness=self.niceness,
                        autostart=False,
                    )
                    for rank in range(self.world_size)
                ]
                return None
            if not self.launched:
                if not all(r.placed() for r in self.ranks):
                    if self.stopping:
                        return None  # wait() ends a group that never ran; nothing is placed again
                    if any(r.returncode is not None for r in self.ranks) or self._group_lost_a_node():
                        self._replace()  # a rank's actor died unplaced, or the group's node
                    return None
                if self.stopping:
                    return self._end(-int(signal.SIGTERM))
                self._rendezvous()
                return None
        except RayError as exc:
            log.warning("%s: placement failed (%s)", self.name, _first_line(exc))
            return self._end(LOST)
        codes = [r.poll() for r in self.ranks]
        failed = [c for c in codes if c is not None and c != 0]
        if failed:
            for r in self.ranks:  # one rank lost ends the job: the others would hang in a collective
                r.kill()
            return self._end(failed[0])
        if all(c == 0 for c in codes):
            return self._end(0)
        return None

    def _group_lost_a_node(self) -> bool:
        """Whether Ray is placing the group again (a node holding its bundles died), looked
        up every :data:`NODE_CHECK_S`: ranks waiting on it wait as long as Ray finds no
        room for the whole group, and the world-size fallback never applies to them."""
        now = time.monotonic()
        if self.pg is None or now - self._pg_checked < NODE_CHECK_S:
            return False
        self._pg_checked = now
        return bool(placement_group_table(self.pg).get("state") == "RESCHEDULING")

    def _replace(self) -> None:
        """Give up a group that lost a node before its ranks started, ranks and all, for a
        new one of the same size (no rank ran: this is no restart; the fallback to fewer
        ranks applies to it as to any group that finds no room)."""
        log.warning(
            "%s: a node holding its placement group died before its ranks started; placing it again",
            self.name,
        )
        for r in self.ranks:
            r.release()
        self.ranks = []
        if self.pg is not None:
            with contextlib.suppress(RayError, ValueError):
                remove_placement_group(self.pg)
        self._place(self._bundles)

    def _bundle_options(self, rank: int) -> dict[str, Any]:
        # The bundle holds the reservation; the actor takes it all (so GPUs are visible to it).
        bundle = self._bundles[rank]
        return {"num_gpus": bundle.get("GPU", 0)} if bundle.get("GPU") else {}

    def _rendezvous(self) -> None:
        """torchrun's environment for every rank: env:// rendezvous at rank 0's node."""
        nodes = [r.node for r in self.ranks]
        assert all(nodes)
        master = self.ranks[0]
        port = int(ray.get(master.actor.free_port.remote(), timeout=30))
        local_index: dict[str, int] = {}
        per_node = Counter(str(n["node_id"]) for n in nodes if n is not None)
        for rank, (proc, node) in enumerate(zip(self.ranks, nodes)):
            assert node is not None
            local = local_index.get(node["node_id"], 0)
            local_index[node["node_id"]] = local + 1
            env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(self.world_size),
                # With its own GPU (CUDA_VISIBLE_DEVICES from Ray) a rank's device is cuda:0.
                "LOCAL_RANK": "0" if node["gpus"] else str(local),
                "LOCAL_WORLD_SIZE": str(per_node[node["node_id"]]),
                "GROUP_RANK": "0",
                "MASTER_ADDR": str(master.node["ip"]),  # type: ignore[index]
                "MASTER_PORT": str(port),
            }
            proc.launch(env)
        self.launched = True
        log.info(
            "%s: %d ranks, rendezvous at %s:%d (%s)",
            self.name,
            self.world_size,
            master.node["ip"],  # type: ignore[index]
            port,
            self.describe_node(),
        )
        if self.on_placed is not None:
            self.on_placed(master.node)  # type: ignore[arg-type]

    def _end(self, code: int) -> int:
        self.returncode = code
        return code

    def send_signal(self, sig: int) -> None:
        self.stopping = True
        for r in self.ranks:
            r.send_signal(sig)

    def kill(self) -> None:
        self.stopping = True
        for r in self.ranks:
            r.kill()
        if not self.launched:
            self._end(LOST)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            code = self.poll()
            if code is not None:
                return code
            if not self.launched and self.stopping:
                return self._end(-int(signal.SIGTERM))
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.name, timeout or 0.0)
            time.sleep(0.05)

    def release(self) -> None:
        for r in self.ranks:
            r.release()
        if self.pg is not None:
            with contextlib.suppress(RayError, ValueError):
                remove_placement_group(self.pg)
            self.pg = None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__
