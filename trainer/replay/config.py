"""The ``replay:`` config block: tables, samplers, rate limiters, the durable log, ports.

One frozen, keyword-only dataclass per part; every error names the field, e.g.
``replay.tables[1].samples_per_insert``. A typical block (50 % demonstrations, 50 %
online data, as RLPD and HIL-SERL sample)::

    replay:
      enabled: true
      demos_from: [runs/teleop-20261130]
      tables:
        - {name: online, source: online, sampler: uniform, max_size: 200000,
           min_size_to_sample: 1000, samples_per_insert: 8, error_buffer: 2000}
        - {name: demos, source: demos, sampler: uniform, max_size: 50000}

``source`` says which chunks feed a table: ``online`` (the gateway's, evaluation
episodes excluded: chunks whose meta has ``eval: true`` never reach a table),
``interventions`` (those of the gateway's steps whose action came from a takeover, e.g.
the console's teleoperation: the HIL-SERL recipe samples them 50/50 with ``online``) or
``demos`` (episodes imported from earlier runs or recorded at the console).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gateway.config import ConfigError

Sampler = Literal["uniform", "prioritized", "fifo", "lifo"]
ItemKind = Literal["transition", "nstep", "sequence"]


@dataclass(frozen=True, kw_only=True)
class TableConfig:
    """One table: which items it holds, how they are sampled, removed and rate limited."""

    name: str = "online"
    """Name the trainer samples by."""
    source: Literal["online", "interventions", "demos"] = "online"
    """Which chunks feed it: the gateway's (``online``), the gateway's steps an operator or
    script took over (``interventions``: flagged ``intervention``; they reach ``online``
    tables too), or demonstrations (``demos``: imported or recorded at the console)."""
    item: ItemKind = "transition"
    """``transition`` (one step and the next observation), ``nstep`` or ``sequence`` (fixed-length slice)."""
    n_step: int = 3
    """Steps summed into one ``nstep`` item."""
    gamma: float = 0.99
    """Discount per step: items carry ``discount`` = gamma (transitions) or gamma^k (n-step), 0 after termination."""
    sequence_length: int = 8
    """Steps in one ``sequence`` item."""
    sequence_stride: int = 1
    """Steps between the starts of two ``sequence`` items of one episode."""
    sampler: Sampler = "uniform"
    """``uniform``, ``prioritized`` (sum tree, priorities from the trainer), ``fifo`` or ``lifo``."""
    priority_exponent: float = 0.6
    """``prioritized``: sampling probability is proportional to priority ** exponent."""
    initial_priority: float | None = None
    """``prioritized``: priority of a new item (None: the largest priority seen so far)."""
    remover: Literal["fifo"] = "fifo"
    """Which item leaves a full table: the oldest inserted."""
    max_size: int = 100_000
    """Most items held; inserting into a full table removes one first."""
    max_times_sampled: int = 0
    """Remove an item after it was sampled this many times (0: never)."""
    min_size_to_sample: int = 1
    """Rate limiter: no sampling before this many items were inserted."""
    samples_per_insert: float | None = None
    """Rate limiter: target samples (items) per inserted item; None: no ratio, only ``min_size_to_sample``."""
    error_buffer: float = 1000.0
    """Rate limiter: how far (in sampled items) the ratio may drift either way before one side waits."""
    max_pending: int = 100_000
    """Items waiting for the rate limiter beyond which ingest refuses chunks (backpressure)."""
    links: bool = False
    """``transition`` items also carry ``row`` and ``next_row`` (store row numbers; a step's ``next_row`` is the ``row`` of its episode's next step), so an on-policy trainer can chain each episode's steps (GAE)."""

    def check(self, where: str) -> None:
        def bad(name: str, text: str) -> ConfigError:
            return ConfigError(f"{where}.{name} {text}, got {getattr(self, name)!r}")

        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise bad("name", "must be a non-empty identifier")
        for name in ("max_size", "n_step", "sequence_length", "sequence_stride", "min_size_to_sample"):
            if getattr(self, name) < 1:
                raise bad(name, "must be >= 1")
        for name in ("max_times_sampled", "max_pending"):
            if getattr(self, name) < 0:
                raise bad(name, "must be >= 0")
        if not 0.0 <= self.gamma <= 1.0:
            raise bad("gamma", "must be in [0, 1]")
        if self.priority_exponent < 0:
            raise bad("priority_exponent", "must be >= 0")
        if self.initial_priority is not None and self.initial_priority <= 0:
            raise bad("initial_priority", "must be > 0")
        if self.links and self.item != "transition":
            raise bad("links", f"is only for item 'transition' (this table holds {self.item!r} items)")
        if self.min_size_to_sample > self.max_size:
            raise bad("min_size_to_sample", f"must be <= max_size ({self.max_size}) or sampling never starts")
        spi = self.samples_per_insert
        if spi is not None:
            if spi <= 0:
                raise bad("samples_per_insert", "must be > 0 (or null for no ratio)")
            # Reverb's rule: the window [offset - buffer, offset + buffer] must let at
            # least one insert and one sample through from any state, or both sides wait
            # for each other forever.
            need = 2 * max(1.0, spi)
            if 2 * self.error_buffer < need:
                raise ConfigError(
                    f"{where}.samples_per_insert {spi} with error_buffer {self.error_buffer} could "
                    f"deadlock: the window 2 * error_buffer must be >= 2 * max(1, samples_per_insert) = {need}"
                )
            if self.max_times_sampled and spi > self.max_times_sampled:
                raise ConfigError(
                    f"{where}.samples_per_insert {spi} is above max_times_sampled "
                    f"{self.max_times_sampled}: items would be removed before the ratio is met, and "
                    f"sampling would stall"
                )


@dataclass(frozen=True, kw_only=True)
class ReplayConfig:
    """The replay service: tables fed by the gateway (and demos), a durable log, sampling."""

    enabled: bool = False
    """Start the replay service and make it the gateway's trajectory sink."""
    tables: list[TableConfig] = field(default_factory=lambda: [TableConfig()])
    """The tables; names must be unique."""
    demos_from: list[str] = field(default_factory=list)
    """Run folders whose episodes are imported into ``source: demos`` tables at start (once)."""
    storage_steps: int = 1_000_000
    """Steps kept in memory for all tables together (a ring: the oldest are dropped first)."""
    storage_bytes: int = 8 << 30
    """Memory for those steps; fewer than ``storage_steps`` are kept when big observations need more."""
    fsync: Literal["never", "interval", "always"] = "always"
    """When the log calls fsync before acknowledging: every group commit (``always``), every ``fsync_interval_s``, or ``never`` (a killed process still loses nothing written)."""
    fsync_interval_s: float = 0.5
    """fsync period with ``fsync: interval``."""
    segment_bytes: int = 64 << 20
    """Size at which the log starts a new segment file."""
    retention_bytes: int = 0
    """Delete the oldest segments while the log is larger than this (0: keep everything)."""
    retention_s: float = 0.0
    """Delete segments older than this many seconds (0: keep everything)."""
    ingest_port: int = 0
    """Port the gateway's sink connects to; 0 picks a free one."""
    sample_port: int = 0
    """Port trainers sample from; 0 picks a free one."""
    control_port: int = 0
    """Port for status and import commands; 0 picks a free one."""
    max_backlog_chunks: int = 256
    """Gateway side: unacknowledged chunks beyond which the gateway stops collecting."""
    resend_timeout_s: float = 2.0
    """Gateway side: resend a chunk not acknowledged within this time."""
    storage_retry_s: float = 1.0
    """Gateway side: wait this long before resending after the service refused (disk full, rate limited)."""
    metrics_interval_s: float = 1.0
    """Period of the service's records in ``metrics.jsonl``."""

    def __post_init__(self) -> None:
        names: set[str] = set()
        for i, table in enumerate(self.tables):
            where = f"replay.tables[{i}]"
            table.check(where)
            if table.name in names:
                raise ConfigError(f"{where}.name {table.name!r} is used by another table")
            names.add(table.name)
        for name in ("ingest_port", "sample_port", "control_port"):
            port = getattr(self, name)
            if not 0 <= port < 65536:
                raise ConfigError(f"replay.{name} must be in 0..65535, got {port}")
        for name in ("storage_steps", "storage_bytes", "segment_bytes", "max_backlog_chunks"):
            if getattr(self, name) < 1:
                raise ConfigError(f"replay.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("retention_bytes", "retention_s"):
            if getattr(self, name) < 0:
                raise ConfigError(
                    f"replay.{name} must be >= 0 (0: keep everything), got {getattr(self, name)}"
                )
        for name in ("fsync_interval_s", "resend_timeout_s", "storage_retry_s", "metrics_interval_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"replay.{name} must be > 0, got {getattr(self, name)}")
        if self.retention_bytes and self.retention_bytes < 2 * self.segment_bytes:
            raise ConfigError(
                f"replay.retention_bytes ({self.retention_bytes}) must be at least two segments "
                f"(2 * segment_bytes = {2 * self.segment_bytes})"
            )

    def table(self, name: str) -> TableConfig:
        for table in self.tables:
            if table.name == name:
                return table
        raise KeyError(f"no replay table {name!r}; tables: {', '.join(t.name for t in self.tables)}")
