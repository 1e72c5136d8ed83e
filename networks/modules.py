"""Policy networks shared by the inference server and the trainer (torch only).

An :class:`ObsEncoder` turns one batch of observations into features: the float (and
integer) arrays of the :class:`~gateway.episode.EnvSpec`, flattened and concatenated in
spec order, and every uint8 ``[H, W, C]`` image through a small CNN. The
:class:`Actor` puts an MLP trunk and a tanh-Gaussian head on it: ``mean`` and
``log_std`` (softly bounded), action ``tanh(mean + std·ε)`` scaled to the action
bounds. ε is an input, drawn by the caller, so the torch module and its ONNX export act
the same for the same ε; ε = 0 is the deterministic action ``tanh(mean)``::

    actor = make_actor(spec, NetworkConfig(hidden_sizes=(256, 256)))
    action = actor(obs, eps)                     # obs: {key: tensor [B, ...]}, eps: [B, *action]
    action, log_prob = actor.sample(obs)         # for SAC: reparameterised, with log-probs
    blob = export_onnx(actor)                    # inputs obs/<key>..., eps; output action

A critic reuses :func:`make_encoder` for its own observation features. The state dict
holds the learned parameters only (action bounds are non-persistent buffers), so what
the trainer publishes is exactly what an actor of the same config loads.
"""

from __future__ import annotations

import io
import math
import warnings
from typing import Any

import numpy as np
import torch
from torch import nn

from gateway.episode import EnvSpec
from networks.config import NetworkConfig, cnn_output_hw, conv_layers, is_image, network_problems

__all__ = ["Actor", "NetworkConfig", "ObsEncoder", "export_onnx", "make_actor", "make_encoder"]

_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "relu": nn.ReLU,
    "tanh": nn.Tanh,
    "elu": nn.ELU,
    "gelu": nn.GELU,
    "silu": nn.SiLU,
}


class ImageEncoder(nn.Module):
    """uint8 ``[B, H, W, C]`` -> features ``[B, cnn_features]`` (scaled to [0, 1], NHWC -> NCHW)."""

    def __init__(self, shape: tuple[int, ...], config: NetworkConfig) -> None:
        super().__init__()
        height, width, channels = shape
        layers: list[nn.Module] = []
        for out, kernel, stride in conv_layers(config.cnn_channels):
            layers += [nn.Conv2d(channels, out, kernel, stride), _ACTIVATIONS[config.activation]()]
            channels = out
        self.convs = nn.Sequential(*layers)
        # Sized by arithmetic, not by a forward pass: on the meta device (the inference
        # server's skeletons) a convolution runs through Python references that import
        # torch's compiler stack, about a second of a server's start-up.
        out_h, out_w = cnn_output_hw(height, width, config.cnn_channels)
        if out_h < 1 or out_w < 1:
            raise ValueError(
                f"a {height}x{width} image is too small for {len(config.cnn_channels)} conv layers "
                f"(kernels {', '.join(str(k) for _, k, _ in conv_layers(config.cnn_channels))}); "
                "use fewer inference.network.cnn_channels or larger images"
            )
        flat = channels * out_h * out_w
        self.project = nn.Sequential(nn.Linear(flat, config.cnn_features), nn.LayerNorm(config.cnn_features))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = image.permute(0, 3, 1, 2).float() / 255.0
        return torch.tanh(self.project(self.convs(x).flatten(1)))


class ObsEncoder(nn.Module):
    """A batch of observations (dict of tensors) -> one feature tensor ``[B, out_features]``."""

    def __init__(self, spec: EnvSpec, config: NetworkConfig) -> None:
        super().__init__()
        self.keys = tuple(spec.observation)
        self.vector_keys = tuple(k for k, a in spec.observation.items() if not is_image(a.dtype, a.shape))
        self.image_keys = tuple(k for k, a in spec.observation.items() if is_image(a.dtype, a.shape))
        self.images = nn.ModuleDict(
            {k: ImageEncoder(tuple(spec.observation[k].shape), config) for k in self.image_keys}
        )
        self.vector_features = sum(math.prod(spec.observation[k].shape) for k in self.vector_keys)
        self.out_features = self.vector_features + config.cnn_features * len(self.image_keys)

    def forward(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        parts = [obs[k].flatten(1).float() for k in self.vector_keys]
        parts += [self.images[k](obs[k]) for k in self.image_keys]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def mlp(inputs: int, hidden: tuple[int, ...], activation: str) -> nn.Sequential:
    layers: list[nn.Module] = []
    for width in hidden:
        layers += [nn.Linear(inputs, width), _ACTIVATIONS[activation]()]
        inputs = width
    return nn.Sequential(*layers)


class Actor(nn.Module):
    """Encoder + MLP trunk + tanh-Gaussian head, scaled to the spec's action bounds."""

    def __init__(self, spec: EnvSpec, config: NetworkConfig) -> None:
        super().__init__()
        self.spec, self.config = spec, config
        self.action_shape = tuple(spec.action.shape)
        self.action_dim = math.prod(self.action_shape)
        self.encoder = ObsEncoder(spec, config)
        self.trunk = mlp(self.encoder.out_features, config.hidden_sizes, config.activation)
        self.head = nn.Linear(config.hidden_sizes[-1], 2 * self.action_dim)
        # The bounds' arithmetic in numpy: on the meta device (the inference server builds
        # skeletons there) torch runs it through Python references that import torch's
        # compiler stack, about a second of a server's start-up.
        low = np.asarray(spec.action.low, np.float32)
        high = np.asarray(spec.action.high, np.float32)
        self.action_mid: torch.Tensor
        self.action_half: torch.Tensor
        self.register_buffer("action_mid", torch.as_tensor((high + low) / 2), persistent=False)
        self.register_buffer("action_half", torch.as_tensor((high - low) / 2), persistent=False)

    def distribution(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mean, log_std)`` of the pre-tanh Gaussian, each ``[B, action_dim]``."""
        mean, raw = self.head(self.trunk(self.encoder(obs))).chunk(2, dim=1)
        lo, hi = self.config.log_std_min, self.config.log_std_max
        log_std = lo + 0.5 * (hi - lo) * (torch.tanh(raw) + 1.0)
        return mean, log_std

    def _scale(self, squashed: torch.Tensor) -> torch.Tensor:
        action = self.action_mid + self.action_half * squashed
        return action.reshape(-1, *self.action_shape)

    def forward(self, obs: dict[str, torch.Tensor], eps: torch.Tensor) -> torch.Tensor:
        """Actions ``[B, *action_shape]`` for noise ``eps`` (zeros: the deterministic action)."""
        mean, log_std = self.distribution(obs)
        return self._scale(torch.tanh(mean + torch.exp(log_std) * eps.reshape(mean.shape)))

    def sample(
        self, obs: dict[str, torch.Tensor], eps: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reparameterised actions and their log-probabilities ``[B]`` (for SAC)."""
        mean, log_std = self.distribution(obs)
        if eps is None:
            eps = torch.randn_like(mean)
        eps = eps.reshape(mean.shape)
        pre = mean + torch.exp(log_std) * eps
        squashed = torch.tanh(pre)
        gauss = -0.5 * eps.pow(2) - log_std - 0.5 * math.log(2 * math.pi)
        # log|d tanh/du| in its stable form, plus the constant of the affine scaling.
        jacobian = 2.0 * (math.log(2.0) - pre - nn.functional.softplus(-2.0 * pre))
        log_prob = (gauss - jacobian).sum(1) - torch.log(self.action_half).sum()
        return self._scale(squashed), log_prob


def _check(spec: EnvSpec, config: NetworkConfig) -> None:
    problems = network_problems(spec, config)
    if problems:
        raise ValueError("the network does not fit the env spec: " + "; ".join(problems))


def make_encoder(spec: EnvSpec, config: NetworkConfig) -> ObsEncoder:
    """The observation encoder alone (for critics)."""
    _check(spec, config)
    return ObsEncoder(spec, config)


def make_actor(spec: EnvSpec, config: NetworkConfig, *, seed: int | None = None) -> Actor:
    """The actor for ``spec``; ``seed`` makes its initial weights reproducible."""
    _check(spec, config)
    if seed is None:
        return Actor(spec, config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Actor(spec, config)


class _Positional(nn.Module):
    """The actor with positional inputs in spec order, as ONNX graphs take them."""

    def __init__(self, actor: Actor) -> None:
        super().__init__()
        self.actor = actor

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        *obs, eps = inputs
        action: torch.Tensor = self.actor(dict(zip(self.actor.encoder.keys, obs)), eps)
        return action


def input_names(spec: EnvSpec) -> list[str]:
    """The ONNX graph's inputs: ``obs/<key>`` in spec order, then ``eps``."""
    return [f"obs/{k}" for k in spec.observation] + ["eps"]


def export_onnx(actor: Actor, opset: int = 17) -> bytes:
    """The actor as an ONNX model (dynamic batch dimension), serialised."""
    spec = actor.spec
    example = tuple(
        torch.zeros((2, *a.shape), dtype=getattr(torch, a.dtype)) for a in spec.observation.values()
    )
    example += (torch.zeros(2, *actor.action_shape),)
    names = input_names(spec)
    buf = io.BytesIO()
    was_training = actor.training
    actor.eval()
    # The TorchScript exporter (dynamo=False): ~0.3 s against ~4 s for the dynamo one,
    # which matters on every server start, and its initializers are exactly the
    # parameters (the dynamo graph adds buffers and constants), so a published state
    # dict maps onto the graph by name. It is deprecated, hence the filter.
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.onnx.export(
                _Positional(actor),
                example,
                buf,  # type: ignore[arg-type]  # torch accepts file objects too
                input_names=names,
                output_names=["action"],
                dynamic_axes={name: {0: "batch"} for name in [*names, "action"]},
                opset_version=opset,
                dynamo=False,
            )
    finally:
        actor.train(was_training)
    return _strip_prefix(buf.getvalue(), "actor.")


def _strip_prefix(blob: bytes, prefix: str) -> bytes:
    """Name the graph's initializers exactly as the actor's state dict does."""
    import onnx

    model = onnx.load_from_string(blob)
    for init in model.graph.initializer:
        if init.name.startswith(prefix):
            init.name = init.name[len(prefix) :]
    for node in model.graph.node:
        node.input[:] = [n[len(prefix) :] if n.startswith(prefix) else n for n in node.input]
    return bytes(model.SerializeToString())


def state_dict_numpy(module: nn.Module) -> dict[str, np.ndarray]:
    """The module's state dict as contiguous numpy arrays on the CPU (what publishers send)."""
    return {k: v.detach().cpu().contiguous().numpy() for k, v in module.state_dict().items()}


def load_numpy(module: nn.Module, arrays: dict[str, Any]) -> None:
    """Copy numpy arrays into the module's parameters (shapes and names must match)."""
    module.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in arrays.items()}, strict=True)
