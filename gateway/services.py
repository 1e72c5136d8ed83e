"""What ``loopgate up`` starts: one :class:`Service` per process, planned from the config.

Each part of loopgate contributes its processes through a plan function registered in
:data:`gateway.registry.PLANS` (``"module:function"``, imported only when the config has that part):
``plan(cfg, run) -> list[Service]``. The core plans the gateway and the env workers;
the inference, replay and trainer parts add theirs. A plan may also add
addresses to ``run.endpoints`` (written to ``endpoints.json`` before anything starts,
so a restarted process binds the same address and its peers find it again).
"""

from __future__ import annotations

import gc
import os
import random
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.config import ExperimentConfig
from gateway.endpoints import rewrite
from gateway.endpoints import write as write_endpoints
from gateway.transport import endpoint


@dataclass
class Service:
    """One supervised process."""

    name: str
    """Unique name; also the log file name (``logs/<name>.log``)."""
    argv: list[str]
    """Command line (``sys.executable -m package.role ...`` for loopgate's own processes)."""
    order: int = 50
    """Start order (low first) and reverse stop order."""
    restart: bool = True
    """Restart when it exits unexpectedly."""
    required: bool = True
    """The run fails when this service cannot be kept running."""
    ready_timeout_s: float = 60.0
    """How long to wait for the service to come up before starting the next group."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables."""
    finishes: bool = False
    """Exiting with status 0 is the service's normal end (e.g. a trainer that finished)."""
    metrics: bool = False
    """It writes ``metrics.jsonl`` records under its name, and serves them at ``/metrics``
    (the URL ``loopgate up`` gives it in ``endpoints.json["metrics"]``)."""

    def __post_init__(self) -> None:
        # ``python -m`` puts the folder it starts in first on the import path: a
        # researcher's own ``trainer.py`` or ``networks.py`` there would hide loopgate's
        # packages of that name. Python 3.11+ leaves it off (3.10 ignores the variable);
        # a module a config names from that folder is still found, after every package
        # (:func:`gateway.registry.find_modules_in_start_folder`). Children inherit it:
        # torchrun's ranks too.
        self.env.setdefault("PYTHONSAFEPATH", "1")


TORCHRUN_MODULES = ("trainer.torchrun", "torch.distributed.run")
"""Modules that run torchrun: loopgate's wrapper (what ``loopgate up`` starts) and torch's own."""


def starts_torchrun(argv: list[str]) -> bool:
    """Whether ``argv`` runs torchrun (a launcher of trainer ranks) rather than a rank itself."""
    return any(module in argv for module in TORCHRUN_MODULES)


@dataclass
class RunContext:
    """What plan functions need: the run folder, its config path and endpoints."""

    run_dir: Path
    config_path: Path
    endpoints: dict[str, Any]
    log_level: str = "INFO"

    def module(self, module: str, *args: str) -> list[str]:
        return [sys.executable, "-m", module, *args, "--log-level", self.log_level]


_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()
_draw = random.Random()
"""Seeded from the OS, not from ``random``'s shared state, which a script may have seeded:
two runs of scripts seeded alike must not draw the same ports."""

PLANNED_PORTS = (20000, 32768)
"""Where a planned port is drawn from: below Linux's default ephemeral range (32768-60999),
out of which the OS gives every outgoing connection its local port. A port planned from
that range can be taken between planning and binding by any process's connection (a Ray
worker's, a browser's) and stay taken for as long as that connection lives; above Ray's
worker ports (10002-19999)."""


def ephemeral_ports(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The OS's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        low, high = (int(x) for x in Path(path).read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def planned_pool(ephemeral: tuple[int, int] | None = None) -> range | None:
    """The ports :func:`free_port` draws from: :data:`PLANNED_PORTS` less the ephemeral range
    (``None`` where that leaves too few, e.g. an ephemeral range widened to 1024-65535)."""
    low, high = PLANNED_PORTS
    e_low, e_high = ephemeral or ephemeral_ports()
    if e_low >= high or e_high < low:
        return range(low, high)
    below, above = range(low, max(low, e_low)), range(min(e_high + 1, high), high)
    pool = below if len(below) >= len(above) else above
    return pool if len(pool) >= 1024 else None


def bindable(host: str, port: int, reuse: bool = False) -> bool:
    """Whether a TCP listener could bind ``host:port`` now (``reuse``: as ZeroMQ and
    Python's HTTP server do, with ``SO_REUSEADDR``, past connections still in TIME_WAIT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        if reuse:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now, never one this process handed out before: the port is
    only bound later by the service it is for, and meanwhile the OS may offer it again (one
    run planned the same port for two services). Drawn from :func:`planned_pool`, out of
    the OS's ephemeral range, where no outgoing connection can take it meanwhile."""
    pool = planned_pool()
    with _handed_out_lock:
        for _ in range(256 if pool is not None else 0):
            port = _draw.choice(pool)  # type: ignore[arg-type]
            if port not in _handed_out and bindable(host, port):
                _handed_out.add(port)
                return port
        while True:  # no pool, or it is full: the OS picks
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = int(s.getsockname()[1])
            if port not in _handed_out:
                _handed_out.add(port)
                return port


def planned(port: int) -> bool:
    """Whether this process planned ``port`` (:func:`free_port`), rather than a config naming it."""
    with _handed_out_lock:
        return port in _handed_out


def replan_taken(run: RunContext, service: str, here: Callable[[str], bool] = lambda host: True) -> list[str]:
    """Before ``service`` (re)starts: give each address it binds on a port this process
    planned, and that another process has taken meanwhile, a new free port, and write
    ``endpoints.json`` (its running peers follow the file, :mod:`gateway.endpoints`). Only
    hosts ``here(host)`` says are this machine's are looked at; a port a config names is
    never moved (binding it then fails with a clear error). The moves, as ``old -> new``."""
    moves: list[str] = []

    def change(scheme: str, host: str, port: int) -> tuple[str, int]:
        if ":" in host or not here(host) or not planned(port) or bindable(host, port, reuse=True):
            return host, port
        new = free_port(host)
        moves.append(f"{scheme}://{host}:{port} -> :{new}")
        return host, new

    if rewrite(run.endpoints, service, change):
        write_endpoints(run.run_dir / "endpoints.json", run.endpoints)
    return moves


def address(cfg: ExperimentConfig, run: RunContext, name: str, port: int) -> str:
    """An address for a service socket under the gateway's transport settings."""
    g = cfg.gateway
    if g.transport == "tcp" and port == 0:
        port = free_port(g.host if g.host != "0.0.0.0" else "127.0.0.1")
    ipc_dir = run.run_dir / "ipc"
    if g.transport == "ipc":
        ipc_dir.mkdir(parents=True, exist_ok=True)
    return endpoint(g.transport, g.host, port, ipc_dir, name)


def plan_gateway(cfg: ExperimentConfig, run: RunContext) -> list[Service]:
    g = cfg.gateway
    run.endpoints["gateway"] = {
        "workers": address(cfg, run, "workers", g.worker_port),
        "clients": address(cfg, run, "clients", g.client_port),
        "control": address(cfg, run, "control", g.control_port),
    }
    argv = run.module(
        "gateway.hub",
        "--config",
        str(run.config_path),
        "--run-dir",
        str(run.run_dir),
        "--spec",
        str(run.run_dir / "spec.json"),
    )
    return [Service(name="gateway", argv=argv, order=20, ready_timeout_s=30.0, metrics=True)]


def plan_workers(cfg: ExperimentConfig, run: RunContext) -> list[Service]:
    services = []
    # Each worker's observation tap (gateway.tap) for watchers such as the web console:
    # on loopback, since it carries no CURVE keys and watchers run beside `loopgate up`.
    ipc = cfg.gateway.transport == "ipc"
    run.endpoints["taps"] = [
        address(cfg, run, f"tap-{i}", 0) if ipc else f"tcp://127.0.0.1:{free_port()}"
        for i in range(cfg.env.workers)
    ]
    for index in range(cfg.env.workers):
        argv = run.module(
            "gateway.worker",
            "--config",
            str(run.config_path),
            "--endpoints",
            str(run.run_dir / "endpoints.json"),
            "--index",
            str(index),
        )
        if cfg.env.python is not None:  # the simulator's own venv (see gateway.venvs)
            argv[0] = os.path.abspath(os.path.expanduser(cfg.env.python))
        services.append(Service(name=f"worker-{index}", argv=argv, order=40))
    return services


def freeze_heap() -> None:
    """Call once a service has started, before its loop: moves every object made so far
    (imported modules, torch, MuJoCo models, a loaded policy) out of the garbage
    collector's reach. A full collection otherwise scans them all, a pause of about
    0.1 s under the GIL in whichever thread sets it off, in the middle of a step or a
    batch. Objects made later are collected as usual."""
    gc.collect()
    gc.freeze()
