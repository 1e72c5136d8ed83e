"""The ``inference`` config block and the policy network's config, both torch-free.

Every registered config block is built for every experiment, so this module imports
nothing heavy; the networks themselves are in :mod:`trainer.networks` (torch)::

    inference:
      enabled: true
      replicas: 2
      backend: onnxruntime              # or torch
      providers: [CUDAExecutionProvider, CPUExecutionProvider]
      max_batch: 256
      max_wait_us: 500
      network: {hidden_sizes: [256, 256], activation: relu}
      weights: null                     # random (init_seed), or a .pt / .npz / .onnx file

:func:`network_problems` checks, without torch, that a network config fits an env
spec (continuous action, images large enough for the CNN); ``loopgate up`` runs it
before anything starts.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from gateway.config import ConfigError

ACTIVATIONS = ("relu", "tanh", "elu", "gelu", "silu")
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
class NetworkConfig:
    """Shape of the policy network shared by the inference server and the trainer."""

    hidden_sizes: tuple[int, ...] = (256, 256)
    """Widths of the MLP trunk's hidden layers."""
    activation: Literal["relu", "tanh", "elu", "gelu", "silu"] = "relu"
    """Activation after every hidden layer (and every conv layer)."""
    cnn_channels: tuple[int, ...] = (32, 64, 64)
    """Output channels of the image encoder's conv layers (kernels 8/4, 4/2, then 3/1)."""
    cnn_features: int = 256
    """Features each image is projected to before joining the vector observations."""
    log_std_min: float = -5.0
    """Lower bound of the actor's log standard deviation."""
    log_std_max: float = 2.0
    """Upper bound of the actor's log standard deviation."""

    def __post_init__(self) -> None:
        for name in ("hidden_sizes", "cnn_channels"):
            value = tuple(getattr(self, name))
            object.__setattr__(self, name, value)
            if not value or not all(isinstance(v, int) and v > 0 for v in value):
                raise ConfigError(
                    f"inference.network.{name} must be a non-empty list of positive ints, got {list(value)}"
                )
        if self.activation not in ACTIVATIONS:
            raise ConfigError(
                f"inference.network.activation must be one of {ACTIVATIONS}, got {self.activation!r}"
            )
        if self.cnn_features < 1:
            raise ConfigError(f"inference.network.cnn_features must be >= 1, got {self.cnn_features}")
        if not self.log_std_min < self.log_std_max:
            raise ConfigError(
                f"inference.network.log_std_min ({self.log_std_min}) must be below log_std_max ({self.log_std_max})"
            )


def conv_layers(channels: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """``(out_channels, kernel, stride)`` of each conv layer of the image encoder."""
    shapes = [(8, 4), (4, 2)]
    return [(c, *(shapes[i] if i < len(shapes) else (3, 1))) for i, c in enumerate(channels)]


def is_image(dtype: str, shape: tuple[int, ...]) -> bool:
    """Observation arrays the CNN encodes: uint8 ``[H, W, C]`` with 1..4 channels."""
    return dtype == "uint8" and len(shape) == 3 and 1 <= shape[2] <= 4


def cnn_output_hw(height: int, width: int, channels: tuple[int, ...]) -> tuple[int, int]:
    """Spatial size after the conv layers (no padding)."""
    for _, kernel, stride in conv_layers(channels):
        height, width = (height - kernel) // stride + 1, (width - kernel) // stride + 1
    return height, width


def network_problems(spec: Any, net: NetworkConfig) -> list[str]:
    """Why ``net`` cannot act in ``spec`` (an :class:`~gateway.episode.EnvSpec`); empty if it can."""
    problems: list[str] = []
    action = spec.action
    if np.dtype(action.dtype).kind != "f":
        problems.append(f"the actor needs a continuous (float) action, the spec's is {action.dtype}")
    if not all(math.isfinite(v) for v in (*action.low, *action.high)):
        problems.append("the actor needs finite action bounds")
    for key, arr in spec.observation.items():
        kind = np.dtype(arr.dtype).kind
        if is_image(arr.dtype, arr.shape):
            h, w = cnn_output_hw(arr.shape[0], arr.shape[1], net.cnn_channels)
            if h < 1 or w < 1:
                problems.append(
                    f"image {key!r} of {arr.shape[0]}x{arr.shape[1]} is too small for "
                    f"{len(net.cnn_channels)} conv layers (inference.network.cnn_channels)"
                )
        elif kind not in "fiub":
            problems.append(f"observation {key!r} has dtype {arr.dtype}, which the encoder cannot read")
    return problems


@dataclass(frozen=True, kw_only=True)
class InferenceConfig:
    """Inference servers: how many, which backend, batching, deadlines, initial weights."""

    enabled: bool = False
    """Start inference servers with ``loopgate up`` (``policy.kind: inference`` needs it)."""
    replicas: int = 1
    """Number of server processes; the gateway balances requests across them."""
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
    max_wait_us: int = 500
    """Longest the first request of a batch waits for more to join it (µs)."""
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "providers", tuple(self.providers))
        object.__setattr__(self, "batch_buckets", tuple(self.batch_buckets))
        positive = {"replicas": self.replicas, "max_batch": self.max_batch}
        for name, value in positive.items():
            if value < 1:
                raise ConfigError(f"inference.{name} must be >= 1, got {value}")
        if self.max_wait_us < 0:
            raise ConfigError(f"inference.max_wait_us must be >= 0, got {self.max_wait_us}")
        for name in ("deadline_ms", "heartbeat_s", "metrics_interval_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"inference.{name} must be > 0, got {getattr(self, name)}")
        if self.replica_timeout_s <= self.heartbeat_s:
            raise ConfigError(
                f"inference.replica_timeout_s ({self.replica_timeout_s}) must be larger than "
                f"inference.heartbeat_s ({self.heartbeat_s})"
            )
        if not self.providers:
            raise ConfigError("inference.providers must name at least one execution provider")
        for p in self.providers:
            if p not in KNOWN_PROVIDERS:
                raise ConfigError(
                    f"inference.providers: unknown provider {p!r}; known: {', '.join(KNOWN_PROVIDERS)}"
                )
        if not _DEVICE.match(self.device):
            raise ConfigError(f"inference.device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.base_port and not 1024 <= self.base_port <= 65535 - 3 * self.replicas:
            raise ConfigError(
                f"inference.base_port must be 0 or in 1024..{65535 - 3 * self.replicas}, got {self.base_port}"
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
