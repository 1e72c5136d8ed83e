"""The ``inference`` config block, torch-free.

Every registered config block is built for every experiment, so this module imports
nothing heavy; the network's shape is a :class:`networks.config.NetworkConfig` and the
torch modules are in :mod:`networks.modules`::

    inference:
      enabled: true
      replicas: 2
      backend: onnxruntime              # or torch
      providers: [CUDAExecutionProvider, CPUExecutionProvider]
      max_batch: 256
      max_wait_us: null                 # 500 on a GPU, 0 on the CPU
      network: {hidden_sizes: [256, 256], activation: relu}
      weights: null                     # random (init_seed), or a .pt / .npz / .onnx file

"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from gateway.config import ConfigError
from networks.config import NetworkConfig

GPU_MAX_WAIT_US = 500
"""``max_wait_us`` of a server on a GPU when the config leaves it null."""

KNOWN_PROVIDERS = (
    "TensorrtExecutionProvider",
    "CUDAExecutionProvider",
    "ROCMExecutionProvider",
    "DmlExecutionProvider",
    "CoreMLExecutionProvider",
    "OpenVINOExecutionProvider",
    "CPUExecutionProvider",
)
WEIGHT_SUFFIXES = (".pt", ".pth", ".npz", ".onnx")
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


@dataclass(frozen=True, kw_only=True)
class InferenceConfig:
    """Inference servers: how many, which backend, batching, deadlines, initial weights."""

    enabled: bool = False
    """Start inference servers with ``loopgate up`` (``policy.kind: inference`` needs it)."""
    replicas: int = 1
    """Number of server processes; the gateway balances requests across them. With
    ``max_replicas``, the fewest ``loopgate up`` keeps running."""
    max_replicas: int = 0
    """Autoscaling: ``loopgate up`` runs between ``replicas`` and this many servers, following
    the gateway's queue (``scale_up_rows``); 0 keeps ``replicas`` fixed."""
    scale_up_rows: float = 64.0
    """Autoscaling: one more replica when the rows the gateway has in flight or waiting, per
    live replica, stay above this for ``scale_window_s``; one fewer below a quarter of it."""
    scale_up_p99: float | None = 1.0
    """Autoscaling: one more replica also when the p99 latency of the gateway's requests
    (the last few seconds, every replica together) stays above this fraction of
    ``deadline_ms`` for ``scale_window_s``; one fewer only when it is below half of it as
    well as the queue below its mark. None: the queue alone decides."""
    scale_window_s: float = 5.0
    """Autoscaling: how long the queue must stay above (or below) its mark before a change."""
    scale_cooldown_s: float = 15.0
    """Autoscaling: the least time between two changes (a new replica needs a while to serve)."""
    backend: Literal["onnxruntime", "torch"] = "onnxruntime"
    """Runtime that executes the policy network."""
    providers: tuple[str, ...] = (
        "TensorrtExecutionProvider",
        "CUDAExecutionProvider",
        "CPUExecutionProvider",
    )
    """onnxruntime execution providers in order of preference; unavailable ones are skipped."""
    device: str = "auto"
    """``auto`` (CUDA when available), ``cpu``, ``cuda`` or ``cuda:N``."""
    max_batch: int = 256
    """Most env rows run in one forward pass."""
    max_wait_us: int | None = None
    """Longest the first request of a batch waits for more to join it (µs); null:
    :data:`GPU_MAX_WAIT_US` on a GPU, where a forward pass costs about as much for one row
    as for hundreds, and 0 on the CPU, where each row costs its share and a request kept
    waiting for company loses more than the shared pass saves."""
    deadline_ms: float = 1000.0
    """Deadline a request gets at the server (the gateway's own, if sooner, wins)."""
    deterministic: bool = True
    """Act with tanh(mean); false samples tanh(mean + std·ε) with ε drawn by the server."""
    seed: int = 0
    """Seed of the server's ε noise (replica ``i`` uses ``seed + i``)."""
    network: NetworkConfig = field(default_factory=NetworkConfig)
    """The policy network (must match the trainer's)."""
    weights: str | None = None
    """Initial weights: a ``.pt``/``.pth``/``.npz`` state dict or an ``.onnx`` model; none = random."""
    init_seed: int = 0
    """Seed of the random initial weights (same on every replica)."""
    initial_version: int = 0
    """Policy version of the initial weights; published weights must be newer."""
    base_port: int = 0
    """First TCP port; replica ``i`` uses ``base_port + 3i`` (requests), ``+1`` (weights), ``+2`` (control); 0 picks free ports."""
    threads: int = 1
    """Intra-op threads of the backend on CPU (0: the library's default)."""
    cuda_ipc: Literal["auto", "off"] = "auto"
    """torch on CUDA: take observations and weights from processes on the same GPU as CUDA IPC handles (:mod:`gateway.cuda_ipc`); ``off``: host arrays only."""
    cuda_graphs: bool = True
    """torch on CUDA: capture one CUDA graph per batch bucket."""
    batch_buckets: tuple[int, ...] = (1, 8, 64, 256)
    """Batch sizes graphs are captured for (torch on CUDA); a batch is padded to the next one."""
    heartbeat_s: float = 0.25
    """Interval of the gateway's heartbeats to each server."""
    replica_timeout_s: float = 1.5
    """Silence after which a server with work in flight is declared down and its work retried."""
    metrics_interval_s: float = 1.0
    """Period of each server's record in ``metrics.jsonl``."""

    def max_wait_on(self, device: str) -> int:
        """``max_wait_us`` for a server whose backend runs on ``device`` (``cpu``, ``cuda:0``)."""
        if self.max_wait_us is not None:
            return self.max_wait_us
        return GPU_MAX_WAIT_US if device.startswith("cuda") else 0

    @property
    def slots(self) -> int:
        """Replica indices a run may use: ``max_replicas`` with autoscaling, else ``replicas``."""
        return max(self.replicas, self.max_replicas)

    def __post_init__(self) -> None:
        object.__setattr__(self, "providers", tuple(self.providers))
        object.__setattr__(self, "batch_buckets", tuple(self.batch_buckets))
        if self.max_replicas and self.max_replicas < self.replicas:
            raise ConfigError(
                f"inference.max_replicas ({self.max_replicas}) must be 0 (no autoscaling) or >= "
                f"inference.replicas ({self.replicas})"
            )
        for name in ("scale_up_rows", "scale_window_s", "scale_cooldown_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"inference.{name} must be > 0, got {getattr(self, name)}")
        if self.scale_up_p99 is not None and not self.scale_up_p99 > 0:
            raise ConfigError(
                f"inference.scale_up_p99 must be > 0 (a fraction of deadline_ms) or null, got {self.scale_up_p99}"
            )
        positive = {"replicas": self.replicas, "max_batch": self.max_batch}
        for name, value in positive.items():
            if value < 1:
                raise ConfigError(f"inference.{name} must be >= 1, got {value}")
        if self.max_wait_us is not None and self.max_wait_us < 0:
            raise ConfigError(f"inference.max_wait_us must be >= 0, got {self.max_wait_us}")
        for name in ("deadline_ms", "heartbeat_s", "metrics_interval_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"inference.{name} must be > 0, got {getattr(self, name)}")
        if self.replica_timeout_s <= self.heartbeat_s:
            raise ConfigError(
                f"inference.replica_timeout_s ({self.replica_timeout_s}) must be larger than "
                f"inference.heartbeat_s ({self.heartbeat_s})"
            )
        if self.cuda_ipc not in ("auto", "off"):
            raise ConfigError(f"inference.cuda_ipc must be auto or off, got {self.cuda_ipc!r}")
        if not self.providers:
            raise ConfigError("inference.providers must name at least one execution provider")
        for p in self.providers:
            if p not in KNOWN_PROVIDERS:
                raise ConfigError(
                    f"inference.providers: unknown provider {p!r}; known: {', '.join(KNOWN_PROVIDERS)}"
                )
        if not _DEVICE.match(self.device):
            raise ConfigError(f"inference.device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.base_port and not 1024 <= self.base_port <= 65535 - 3 * self.slots:
            raise ConfigError(
                f"inference.base_port must be 0 or in 1024..{65535 - 3 * self.slots}, got {self.base_port}"
            )
        if self.threads < 0:
            raise ConfigError(f"inference.threads must be >= 0, got {self.threads}")
        if self.initial_version < 0:
            raise ConfigError(f"inference.initial_version must be >= 0, got {self.initial_version}")
        buckets = self.batch_buckets
        if not buckets or any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ConfigError(
                f"inference.batch_buckets must be increasing positive ints, got {list(buckets)}"
            )
        if self.weights is not None and not self.weights.endswith(WEIGHT_SUFFIXES):
            raise ConfigError(
                f"inference.weights must be a {', '.join(WEIGHT_SUFFIXES)} file, got {self.weights!r}"
            )

    def check_weights_file(self) -> None:
        """Raise :class:`ConfigError` when ``weights`` names a file that is not there."""
        if self.weights is not None and not Path(self.weights).is_file():
            raise ConfigError(f"inference.weights: {self.weights!r} does not exist")
