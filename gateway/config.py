"""Typed experiment configs, loaded from one YAML file per experiment.

An experiment config has one top-level block per part of the system (``env``,
``policy``, ``gateway``, ``run``, and the blocks the inference, replay and trainer
parts register in :data:`gateway.registry.CONFIG_BLOCKS`). Each block is a
frozen, keyword-only dataclass validated in ``__post_init__``; every error names the
field and the bad value::

    cfg = load_config("configs/reach_sim.yaml", overrides=["env.num_envs=8"])
    cfg.env.num_envs          # 8
    cfg.to_dict()             # the resolved config, written into the run folder

A sim config and its real twin differ only in their ``env:`` block.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from gateway.factory import ConfigError, build
from gateway.protocol.codec import Limits
from gateway.registry import BACKENDS, CONFIG_BLOCKS, POLICIES, resolve

__all__ = [
    "ConfigError",
    "EnvConfig",
    "ExperimentConfig",
    "GatewayConfig",
    "Placement",
    "PolicyConfig",
    "RunConfig",
    "build",
    "from_dict",
    "load_config",
]


@dataclass(frozen=True, kw_only=True)
class EnvConfig:
    """Which environments the env workers host."""

    backend: str = "mujoco_reach"
    """Episode backend name (see ``gateway.registry.BACKENDS``)."""
    workers: int = 1
    """Number of env worker processes."""
    num_envs: int = 1
    """Envs hosted by each worker (the batch dimension of its messages)."""
    seed: int = 0
    """Base seed; worker ``w`` seeds env ``i`` with ``seed + 1000 * w + i``."""
    options: dict[str, Any] = field(default_factory=dict)
    """Backend-specific options, validated by the backend's own ``Config``."""
    python: str | None = None
    """Interpreter of the env workers when the simulator lives in another venv
    (``.venv-mjlab/bin/python``, an Isaac Sim venv); relative to where ``loopgate up`` runs.
    It needs loopgate installed with the ``worker`` extra; the env spec is read there too."""

    def __post_init__(self) -> None:
        if self.python is not None and not self.python.strip():
            raise ConfigError("env.python must be a path to a Python interpreter, got an empty string")
        if self.backend not in BACKENDS:
            raise ConfigError(
                f"env.backend: unknown backend {self.backend!r}; known: {', '.join(sorted(BACKENDS))}"
            )
        if self.workers < 1:
            raise ConfigError(f"env.workers must be >= 1, got {self.workers}")
        if self.num_envs < 1:
            raise ConfigError(f"env.num_envs must be >= 1, got {self.num_envs}")


@dataclass(frozen=True, kw_only=True)
class PolicyConfig:
    """Where actions come from."""

    kind: str = "random"
    """``random``, ``zero``, ``reach_pd`` (in-process scripted), ``inference`` (inference servers) or ``external`` (a ``gateway.client`` drives the envs)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Options of a scripted policy (e.g. ``gain`` of ``reach_pd``)."""
    seed: int = 0
    """Seed of stochastic scripted policies."""

    def __post_init__(self) -> None:
        allowed = {*POLICIES, "inference", "external"}
        if self.kind not in allowed:
            raise ConfigError(
                f"policy.kind: unknown policy {self.kind!r}; known: {', '.join(sorted(allowed))}"
            )


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    """The gateway process: sockets, recording, liveness."""

    host: str = "127.0.0.1"
    """Interface to bind; anything but loopback requires ``curve_keys``."""
    transport: Literal["tcp", "ipc"] = "tcp"
    """``tcp`` (host:port) or ``ipc`` (unix sockets under the run folder, one machine only)."""
    worker_port: int = 0
    """Port env workers connect to; 0 picks a free one."""
    client_port: int = 0
    """Port ``gateway.client`` envs connect to; 0 picks a free one."""
    control_port: int = 0
    """Port for status and commands (the CLI, the trainer, scripts); 0 picks a free one."""
    curve_keys: str | None = None
    """Folder made by ``loopgate keys``; enables CURVE authentication on every socket."""
    chunk_steps: int = 64
    """Steps per trajectory chunk handed to the sink (episode ends flush early)."""
    shared_memory: Literal["auto", "on", "off"] = "auto"
    """Large batches from workers on this host through shared memory, only handles on the
    socket (:mod:`gateway.shm`): ``auto`` when the worker's gateway address is local, ``on``
    whenever the gateway can map the segment, ``off`` never (frames)."""
    local_link: Literal["auto", "off"] = "auto"
    """Workers on this host talk to the gateway over a unix socket instead of ZeroMQ's TCP
    (:mod:`gateway.local_link`): ``auto`` when their address is local and no ``curve_keys``
    are set, ``off`` never."""
    cuda_ipc: Literal["auto", "on", "off"] = "auto"
    """Observations already on a GPU also go to inference servers on that GPU as CUDA IPC handles (:mod:`gateway.cuda_ipc`): ``auto`` for a local gateway, ``on`` whenever the hosts match, ``off`` never."""
    heartbeat_s: float = 1.0
    """Interval of heartbeats between idle peers."""
    worker_timeout_s: float = 5.0
    """Silence after which a worker is declared gone and its episodes interrupted."""
    spool_fsync: Literal["never", "interval", "always"] = "interval"
    """When the spool calls fsync: a killed process never loses written steps; fsync protects against power loss."""
    spool_fsync_interval_s: float = 1.0
    """fsync period with ``spool_fsync: interval``."""
    action_deadline_s: float = 5.0
    """How long the gateway waits for the policy's actions for one observation before it
    asks again (an inference server that died, a lost request)."""
    stop_drain_s: float = 10.0
    """At a stop nobody drained first (a signal): how long the sink gets to store what is
    recorded before the gateway exits; the rest stays in the spool for the next start."""
    limits: Limits = field(default_factory=Limits)
    """Size limits for incoming messages."""

    def __post_init__(self) -> None:
        for name in ("shared_memory", "cuda_ipc"):
            if getattr(self, name) not in ("auto", "on", "off"):
                raise ConfigError(f"gateway.{name} must be auto, on or off, got {getattr(self, name)!r}")
        if self.local_link not in ("auto", "off"):
            raise ConfigError(f"gateway.local_link must be auto or off, got {self.local_link!r}")
        if not self.action_deadline_s > 0:
            raise ConfigError(f"gateway.action_deadline_s must be > 0, got {self.action_deadline_s}")
        if self.stop_drain_s < 0:
            raise ConfigError(f"gateway.stop_drain_s must be >= 0, got {self.stop_drain_s}")
        for name in ("worker_port", "client_port", "control_port"):
            port = getattr(self, name)
            if not 0 <= port < 65536:
                raise ConfigError(f"gateway.{name} must be in 0..65535, got {port}")
        if self.chunk_steps < 1:
            raise ConfigError(f"gateway.chunk_steps must be >= 1, got {self.chunk_steps}")
        if self.heartbeat_s <= 0:
            raise ConfigError(f"gateway.heartbeat_s must be > 0, got {self.heartbeat_s}")
        if self.worker_timeout_s <= self.heartbeat_s:
            raise ConfigError(
                f"gateway.worker_timeout_s ({self.worker_timeout_s}) must be larger than gateway.heartbeat_s ({self.heartbeat_s})"
            )
        if self.transport == "tcp" and not _is_loopback(self.host) and not self.curve_keys:
            raise ConfigError(
                f"gateway.host {self.host!r} is not loopback: set gateway.curve_keys (make keys with `loopgate keys DIR`)"
            )


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where one service (or each trainer rank) may run under ``run.engine: ray``, and what it
    reserves there. Ignored by the local engine."""

    num_cpus: float = 1.0
    """CPUs it reserves (Ray's logical CPUs: a reservation, not a limit)."""
    num_gpus: float = 0.0
    """GPUs it reserves (an inference replica, a trainer rank); Ray sets ``CUDA_VISIBLE_DEVICES``."""
    memory_mb: int = 0
    """Memory it reserves, in MiB (0: none)."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom resources it needs (``{robot_arm0: 1}``): only nodes started with them qualify."""
    labels: dict[str, str] = field(default_factory=dict)
    """Node labels it needs (``{loopgate/host: arm0}``), matched by Ray's label selector."""

    def __post_init__(self) -> None:
        # ValueError, not ConfigError: ``build`` prefixes the path (``run.placement.worker``).
        for name in ("num_cpus", "num_gpus"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.memory_mb < 0:
            raise ValueError(f"memory_mb must be >= 0, got {self.memory_mb}")
        for key, amount in self.resources.items():
            if not amount > 0:
                raise ValueError(f"resources.{key} must be > 0, got {amount}")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The run as a whole: budget, run folder, supervision."""

    max_env_steps: int | None = None
    """Stop after this many recorded env steps (``None``: run until Ctrl-C or the trainer finishes).
    Evaluation rounds a trainer asks for (``trainer.eval_every``, the final evaluation) run
    past it: a budget spent before one leaves it unscored otherwise."""
    run_dir: str | None = None
    """Run folder; default ``runs/<config name>-<timestamp>``."""
    log_level: str = "INFO"
    """Log level of every process."""
    status_interval_s: float = 0.5
    """Refresh period of the live status table and of ``metrics.jsonl``."""
    start_notice_s: float = 10.0
    """A worker that has not registered with the gateway this long after it started (a
    robot that does not publish, a simulator still loading) is reported on the console with
    its log's last line, and again as often (:class:`gateway.live.StartupWatch`)."""
    max_restarts: int = 5
    """Restarts of one crashed process before ``loopgate up`` gives up."""
    drain_timeout_s: float = 30.0
    """Time given to services to flush on shutdown before they are killed."""
    nice: dict[str, int] = field(default_factory=dict)
    """Scheduling niceness by service name or name prefix (``{trainer: 10}``): on a machine
    the trainer shares with collection, a niced trainer leaves the cores to the latency
    path first and still takes every idle cycle. Applied when each service starts, to the
    process and its session. Below 0 (a higher priority, e.g. ``{gateway: -5, console: -5}``
    for a fast e-stop on saturated cores) needs ``CAP_SYS_NICE`` or a ``nice`` limit in
    ``/etc/security/limits.conf``; without it ``loopgate up`` refuses the config."""
    realtime_priority: int = 10
    """Real-time (``SCHED_FIFO``) priority, 1-99, of the control loop's hub, its policy and
    the e-stop's path: every thread of the gateway and of each inference server, and the
    console's event loop with its ZeroMQ I/O threads, so neither an e-stop nor an action
    waits for a core that simulators, cameras, browsers or the trainer keep busy. Each of
    them works only when asked (an observation, a request, a click), so none can take the
    cores from the rest; env workers, which a fast simulator keeps stepping, stay at
    normal priority (``run.nice`` raises them). Taken where the system allows it
    (``CAP_SYS_NICE``, or an ``rtprio`` limit in ``/etc/security/limits.conf`` as
    real-time ROS 2 setups have); elsewhere logged once and left at normal priority.
    ZeroMQ's I/O threads run one above it, so a sent message leaves at once. 0: off."""
    engine: Literal["local", "ray"] = "local"
    """Who starts and watches the services: ``local`` (child processes of ``loopgate up``) or
    ``ray`` (one Ray actor per service on a Ray cluster; ``loopgate up --ray ADDRESS``)."""
    ray_address: str | None = None
    """Ray cluster to join with ``engine: ray`` (``auto``: ``RAY_ADDRESS``); ``None`` starts a
    one-machine Ray instance for the run."""
    placement: dict[str, Placement] = field(default_factory=dict)
    """Under ``engine: ray``: resources and node constraints by service name or name prefix
    (``{inference: {num_gpus: 1}, worker-0: {resources: {robot_arm0: 1}}}``); the longest
    matching entry wins; ``trainer`` applies to each rank."""
    trainer_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How the trainer's ranks share nodes: Ray placement group strategy of their bundles."""

    def placement_for(self, name: str) -> Placement:
        """``placement`` for service ``name``: its own entry, else the longest matching prefix."""
        if name in self.placement:
            return self.placement[name]
        prefixes = [p for p in self.placement if name.startswith(p)]
        return self.placement[max(prefixes, key=len)] if prefixes else Placement()

    def __post_init__(self) -> None:
        for name, value in self.nice.items():
            if not -20 <= value <= 19:
                raise ConfigError(f"run.nice.{name} must be in -20..19, got {value}")
        if not 0 <= self.realtime_priority <= 99:
            raise ConfigError(
                f"run.realtime_priority must be in 0..99 (0: off), got {self.realtime_priority}"
            )
        if self.max_env_steps is not None and self.max_env_steps < 1:
            raise ConfigError(f"run.max_env_steps must be >= 1, got {self.max_env_steps}")
        if self.log_level.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
            raise ConfigError(f"run.log_level must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")
        if self.status_interval_s <= 0:
            raise ConfigError(f"run.status_interval_s must be > 0, got {self.status_interval_s}")
        if self.max_restarts < 0:
            raise ConfigError(f"run.max_restarts must be >= 0, got {self.max_restarts}")
        if self.start_notice_s <= 0:
            raise ConfigError(f"run.start_notice_s must be > 0, got {self.start_notice_s}")


def _is_loopback(host: str) -> bool:
    return host in {"127.0.0.1", "localhost", "::1"} or host.startswith("127.")


# ------------------------------------------------------------------------ experiment


class ExperimentConfig:
    """All blocks of one experiment; ``cfg.<block>`` is the block's dataclass."""

    def __init__(self, blocks: Mapping[str, Any], name: str = "experiment") -> None:
        self._blocks = dict(blocks)
        self.name = name

    def __getattr__(self, block: str) -> Any:
        try:
            return self.__dict__["_blocks"][block]
        except KeyError:
            raise AttributeError(f"config has no block {block!r}") from None

    def has(self, block: str) -> bool:
        return block in self._blocks

    def to_dict(self) -> dict[str, Any]:
        return {name: to_plain(block) for name, block in self._blocks.items()}

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump({"name": self.name, **self.to_dict()}, sort_keys=False))


def to_plain(value: Any) -> Any:
    """Dataclasses, tuples and mappings as plain YAML/JSON-able values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    return value


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"block.key.sub=value"`` -> (path, YAML-parsed value)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: expected block.key=value")
    path = key.strip().split(".")
    if len(path) < 2 or not all(path):
        raise ConfigError(f"--set {text!r}: the key must name a block and a field, e.g. env.num_envs=4")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {text!r}: value is not valid YAML: {exc}") from exc
    return path, value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {text!r}: {part!r} is not a block or mapping")
            node = child
        node[path[-1]] = value
    return data


def from_dict(
    data: Mapping[str, Any], overrides: Sequence[str] = (), name: str | None = None
) -> ExperimentConfig:
    """Validate a config mapping (as read from YAML) into an :class:`ExperimentConfig`."""
    raw = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in data.items()}
    exp_name = str(raw.pop("name", name or "experiment"))
    raw = apply_overrides(raw, overrides)
    unknown = sorted(set(raw) - set(CONFIG_BLOCKS))
    if unknown:
        raise ConfigError(
            f"unknown config block(s) {', '.join(unknown)}; known: {', '.join(sorted(CONFIG_BLOCKS))}"
        )
    blocks: dict[str, Any] = {}
    for block in CONFIG_BLOCKS:
        value = raw.get(block)
        if value is None:
            value = {}
        if not isinstance(value, Mapping):
            raise ConfigError(f"{block}: must be a mapping of keys, got {value!r}")
        cls = resolve(CONFIG_BLOCKS, block, "config block")
        blocks[block] = build(cls, value, block)
    cfg = ExperimentConfig(blocks, name=exp_name)
    check_backend_options(cfg)
    check_policy_options(cfg)
    return cfg


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Read, override and validate the YAML experiment config at ``path``."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(
            f"config file {str(path)!r} is a folder; give a YAML file (e.g. configs/reach_sim.yaml)"
        )
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: the top level must be a mapping of blocks")
    return from_dict(data, overrides, name=path.stem)


def check_backend_options(cfg: ExperimentConfig) -> None:
    """Validate ``env.options`` with the backend's own ``Config`` dataclass."""
    backend_cls = resolve(BACKENDS, cfg.env.backend, "backend")
    options_cls = getattr(backend_cls, "Config", None)
    if options_cls is not None:
        build(options_cls, cfg.env.options, "env.options")


def check_policy_options(cfg: ExperimentConfig) -> None:
    """Validate ``policy.options`` with the in-process policy's own ``Config`` dataclass."""
    policy = cfg.policy
    if policy.kind not in POLICIES:  # inference servers and external clients take no options
        if policy.options:
            raise ConfigError(
                f"policy.options: policy.kind {policy.kind!r} takes no options, got {sorted(policy.options)}"
            )
        return
    options_cls = getattr(resolve(POLICIES, policy.kind, "policy"), "Config", None)
    if options_cls is None:
        if policy.options:
            raise ConfigError(
                f"policy.options: policy {policy.kind!r} takes no options, got {sorted(policy.options)}"
            )
        return
    build(options_cls, policy.options, "policy.options")
