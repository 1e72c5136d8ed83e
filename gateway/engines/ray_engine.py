"""The Ray engine: a run's services as Ray actors on a Ray cluster (``run.engine: ray``).

    loopgate up configs/reach_sim.yaml --ray auto          # join the cluster at RAY_ADDRESS
    loopgate up configs/reach_sim.yaml --ray 10.0.0.1:6379 # or at that address
    loopgate up configs/reach_sim.yaml --set run.engine=ray  # a one-machine Ray for this run

The driver (``loopgate up``) plans exactly what the local engine starts, writes the run
folder and ``endpoints.json``, and then asks Ray for one :class:`~gateway.engines.ray_procs.
ServiceHost` actor per service, with what ``run.placement`` says the service needs (CPUs,
GPUs, memory, custom resources, node labels); the trainer's ranks get one placement group
(``run.trainer_strategy``). Each actor runs the service's usual command as its own process
with its own ZeroMQ sockets; the supervisor restarts what exits, and Ray places the restart
on a node that still fits (a lost node's services move; a robot's worker, which only its
host fits, waits for it).

Addresses. With ``gateway.host`` on loopback, every node must be this machine (a
``ray.cluster_utils.Cluster``, or ``ray start`` twice on one host); anything else is refused
before a service starts. A node of this machine started at a loopback IP of its own
(``ray start --node-ip-address 127.0.0.2``) has its services bind that IP; the others bind
``gateway.host``. With ``gateway.host: 0.0.0.0`` (and ``gateway.curve_keys``), each
service binds its node's IP. Once Ray has placed a service (first or after a restart), the
driver writes the address it will bind into its ``endpoints.json`` entries before the
process starts: services started later read it there, and running peers that dialled its
old address follow the file (:mod:`gateway.endpoints`) and reconnect to the new one.
The run folder must be on storage every node mounts at the same path (logs, spool, replay
log, checkpoints and ``endpoints.json`` live there), and every node needs the same Python
environment at the same path.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

from gateway.config import ConfigError, ExperimentConfig, Placement
from gateway.endpoints import rewrite
from gateway.endpoints import write as write_endpoints
from gateway.services import starts_torchrun
from gateway.transport import is_loopback

log = logging.getLogger("loopgate.ray")

OBJECT_STORE_BYTES = 100 << 20
"""Object store of a Ray instance ``loopgate up`` starts itself: no data goes through it."""
SYSTEM_CONFIG = {"health_check_period_ms": 1000, "health_check_failure_threshold": 5, "worker_niceness": 0}
"""A node silent for about 5 s is declared dead (Ray's default: 30 s), so its services move
sooner; actors (and so the services) at niceness 0, not Ray's 15, as under the local engine."""
FORWARDED_ENV = (
    "LOOPGATE_",
    "MUJOCO_GL",
    "PYOPENGL_PLATFORM",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "PYTHONPATH",
    "ROS_",
    "RMW_",
)
"""Driver environment variables the services get on every node (their own node's
environment is the base)."""
PROBE_TIMEOUT_S = 10.0
"""How long ``loopgate up`` tries to reach a cluster's GCS before it says there is none."""


def bind_host(gateway_host: str, node_ip: str) -> str:
    """The host a service placed on the node at ``node_ip`` binds: the node's IP, except
    that with ``gateway.host`` on loopback a node on a non-loopback IP (this machine's
    address: :func:`check_cluster` refused other machines) serves on ``gateway.host``."""
    if is_loopback(gateway_host) and not is_loopback(node_ip):
        return gateway_host
    return node_ip


class RayEngine:
    """Connects to (or starts) a Ray cluster and launches services on it."""

    name = "ray"

    def __init__(self, cfg: ExperimentConfig) -> None:
        try:
            import ray
        except ImportError as exc:
            raise ConfigError(
                "run.engine is 'ray' but Ray is not installed: pip install -e '.[ray]'"
            ) from exc
        self.ray = ray
        address = cfg.run.ray_address
        if address:
            probe_gcs(os.environ.get("RAY_ADDRESS", "") if address == "auto" else address)
        try:
            if address:
                ray.init(address=address, log_to_driver=False, namespace="loopgate")
            else:
                ray.init(
                    num_cpus=os.cpu_count() or 1,
                    include_dashboard=False,
                    object_store_memory=OBJECT_STORE_BYTES,
                    log_to_driver=False,
                    namespace="loopgate",
                    _system_config=SYSTEM_CONFIG,
                )
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ConfigError(f"run.ray_address {address!r}: cannot join a Ray cluster: {exc}") from exc
        nodes = [n for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]
        log.info(
            "Ray cluster: %d node(s), %s",
            len(nodes),
            ", ".join(f"{n['NodeManagerAddress']} {n['NodeID'][:8]}" for n in nodes),
        )
        try:
            check_cluster(cfg, nodes, ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
        except ConfigError:
            ray.shutdown()
            raise

    def launcher(self, cfg: ExperimentConfig, run: Any) -> RayLauncher:
        return RayLauncher(cfg, run)

    def close(self) -> None:
        self.ray.shutdown()


def probe_gcs(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Fail fast on a ``host:port`` nobody listens at: Ray itself retries for minutes."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return  # "auto" without RAY_ADDRESS (a local cluster), or a scheme Ray resolves itself
    log.info("joining the Ray cluster at %s (up to %.0f s)", address, timeout_s)
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConfigError(f"run.ray_address {address!r}: no Ray cluster answers there ({exc})") from exc


def check_cluster(cfg: ExperimentConfig, nodes: list[dict[str, Any]], driver_ip: str) -> None:
    """Refuse a cluster the run's addresses cannot span, and placements no node could ever
    satisfy (a typo in a resource name would otherwise wait forever)."""
    if cfg.gateway.transport == "ipc" and len({n["NodeManagerAddress"] for n in nodes}) > 1:
        raise ConfigError("gateway.transport ipc works on one machine only; use tcp on a Ray cluster")
    if is_loopback(cfg.gateway.host):
        # Nodes at loopback IPs of their own (127.0.0.2, ...) are on this machine too.
        others = sorted(
            ip for ip in {n["NodeManagerAddress"] for n in nodes} - {driver_ip} if not is_loopback(ip)
        )
        if others:
            raise ConfigError(
                f"gateway.host {cfg.gateway.host!r} is loopback but the Ray cluster has nodes on other hosts "
                f"({', '.join(others)}): set gateway.host=0.0.0.0 and gateway.curve_keys (docs/cluster.md)"
            )
    known = {r for n in nodes for r in n.get("Resources", {})}
    for name, placement in cfg.run.placement.items():
        missing = sorted(set(placement.resources) - known)
        # A robot host may be down right now: its worker then waits for it; a resource no
        # node has ever had is far more likely a typo, and is named.
        if missing:
            log.warning(
                "run.placement.%s needs %s, which no node of the cluster has now; it waits for one",
                name,
                ", ".join(missing),
            )


def actor_options(placement: Placement) -> dict[str, Any]:
    """Ray actor options for one service's :class:`Placement`."""
    options: dict[str, Any] = {"num_cpus": placement.num_cpus, "num_gpus": placement.num_gpus}
    if placement.memory_mb:
        options["memory"] = placement.memory_mb << 20
    if placement.resources:
        options["resources"] = dict(placement.resources)
    if placement.labels:
        options["label_selector"] = dict(placement.labels)
    return options


def bundle(placement: Placement) -> dict[str, float]:
    """One trainer rank's placement-group bundle."""
    out: dict[str, float] = {"CPU": placement.num_cpus}
    if placement.num_gpus:
        out["GPU"] = placement.num_gpus
    if placement.memory_mb:
        out["memory"] = float(placement.memory_mb << 20)
    out.update(placement.resources)
    return out


def rank_argv(argv: list[str]) -> list[str]:
    """A rank's own command from a ``torchrun ... -m trainer ARGS`` command line: the Ray
    engine is the launcher, so each rank runs ``python -m trainer ARGS``."""
    if not starts_torchrun(argv):
        return argv
    last_m = max(i for i, a in enumerate(argv) if a == "-m")
    return [argv[0], "-m", *argv[last_m + 1 :]]


def forwarded_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if k.startswith(FORWARDED_ENV)}


def rehost(endpoints: dict[str, Any], service: str, ip: str) -> bool:
    """Point ``service``'s addresses in ``endpoints`` at ``ip``; whether any changed."""
    return rewrite(endpoints, service, lambda scheme, host, port: (ip, port))


class RayLauncher:
    """Starts each planned service on the cluster; the supervisor's ``launcher``."""

    def __init__(self, cfg: ExperimentConfig, run: Any) -> None:
        self.cfg, self.run = cfg, run
        self.rehost = not is_loopback(cfg.gateway.host)
        """Whether a service's addresses are known only once Ray has placed it (on loopback
        they are planned; one that moves to a node of its own loopback IP is followed)."""

    def start(self, service: Any, log_path: Path, env: dict[str, str], niceness: int) -> Any:
        from gateway.engines.ray_procs import RayProcess
        from gateway.engines.ray_ranks import RankGroup

        env = {**forwarded_env(), **env}
        placement = self.cfg.run.placement_for(service.name)
        on_placed = self._placed(service.name)
        if starts_torchrun(service.argv):
            tc = self.cfg.trainer
            sizes = tc.world_sizes()
            return RankGroup(
                service.name,
                [bundle(placement) for _ in range(sizes[0])],
                self.cfg.run.trainer_strategy,
                rank_argv(service.argv),
                env,
                str(log_path),
                niceness=niceness,
                label_selector=placement.labels or None,
                on_placed=on_placed,
                smaller=sizes[1:],
                shrink_after_s=tc.shrink_after_s,
            )
        return RayProcess(
            service.name,
            actor_options(placement),
            service.argv,
            env,
            str(log_path),
            niceness=niceness,
            on_placed=on_placed,
        )

    def _placed(self, name: str) -> Any:
        def placed(node: dict[str, Any]) -> None:
            host = bind_host(self.cfg.gateway.host, node["ip"])
            if rehost(self.run.endpoints, name, host):
                write_endpoints(self.run.run_dir / "endpoints.json", self.run.endpoints)
                log.info("%s binds %s: endpoints.json updated, its running peers follow it", name, host)

        return placed

    def placed(self, handle: Any) -> bool:
        """Whether ``handle``'s addresses are final: at once on loopback, where they never
        change; on other interfaces once Ray has placed it and its node's IP is written."""
        return not self.rehost or handle.state != "placing"

    def end_session(self, handle: Any) -> None:
        handle.release()

    def describe(self, handle: Any) -> tuple[str, str]:
        """The handle's state (``placing`` while Ray finds it a node) and where it runs."""
        return handle.state, handle.describe_node()


__all__ = [
    "RayEngine",
    "RayLauncher",
    "actor_options",
    "bind_host",
    "bundle",
    "check_cluster",
    "rank_argv",
    "rehost",
]
