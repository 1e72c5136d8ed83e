"""The policy network's config, shared bit for bit by the trainer and the inference servers.

Torch-free (every registered config block is built for every experiment): the
``inference.network`` block is a :class:`NetworkConfig`; :func:`network_problems` checks,
without torch, that it fits an env spec (continuous action, images large enough for the
CNN), and ``loopgate up`` runs it before anything starts. The torch modules and the ONNX
export are in :mod:`networks.modules`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from gateway.config import ConfigError

ACTIVATIONS = ("relu", "tanh", "elu", "gelu", "silu")


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
