"""The trainer's ranks as Ray actors, in one placement group.

One actor per bundle of one placement group, rendezvous by ``torch.distributed``'s env:// variables (``MASTER_ADDR`` is rank 0's
node, ``MASTER_PORT`` a port free there): what ``torchrun`` would set. One rank lost
ends them all and frees the group; the restart gets a new placement group and the
trainer resumes from its last checkpoint. With several world sizes allowed
(``trainer.min_nproc``), a group that finds no room within ``trainer.shrink_after_s``
is given up for one a rank smaller, down to the smallest: the trainer then resumes at
that size (its DCP checkpoint reshards on load).

Each rank is a :class:`~gateway.engines.ray_procs.RayProcess`; the group looks like one
:class:`subprocess.Popen` to the supervisor, as a single service does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import RayError
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from gateway.engines.ray_procs import LOST, NODE_CHECK_S, RayProcess, first_line, ref_ready

log = logging.getLogger("loopgate.ray")


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
                if not ref_ready(self._pg_ready):
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
            log.warning("%s: placement failed (%s)", self.name, first_line(exc))
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
