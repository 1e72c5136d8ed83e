"""The shared policy networks, both backends, the weights wire format and the config block."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from gateway.config import ConfigError, from_dict
from gateway.episode import ActionSpec, ArraySpec, EnvSpec
from gateway.factory import experiment_spec
from inference.backends import OrtBackend, TorchBackend
from inference.config import InferenceConfig
from inference.weights import (
    WeightsAssembler,
    WeightsError,
    check_state_dict,
    transfer_messages,
)
from networks.config import NetworkConfig
from networks.modules import export_onnx, make_actor, make_encoder, state_dict_numpy

pytestmark = pytest.mark.unit

SMALL = NetworkConfig(hidden_sizes=(32, 32), cnn_channels=(4, 8), cnn_features=16)


def image_spec() -> EnvSpec:
    base = experiment_spec("mujoco_reach", {})
    observation = {**base.observation, "image": ArraySpec(dtype="uint8", shape=(36, 36, 3))}
    return dataclasses.replace(base, observation=observation)


def random_obs(spec: EnvSpec, n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for key, arr in spec.observation.items():
        if arr.dtype == "uint8":
            out[key] = rng.integers(0, 256, (n, *arr.shape), dtype=np.uint8)
        else:
            out[key] = rng.standard_normal((n, *arr.shape)).astype(arr.dtype)
    return out


@pytest.mark.parametrize("spec_name", ["proprio", "image"])
@pytest.mark.parametrize("deterministic", [True, False])
def test_a_torch_model_gives_the_same_actions_in_both_backends(spec_name, deterministic):
    spec = experiment_spec("mujoco_reach", {}) if spec_name == "proprio" else image_spec()
    cfg = InferenceConfig(network=SMALL, init_seed=3)
    torch_policy = TorchBackend(spec, dataclasses.replace(cfg, backend="torch")).initial()
    ort_policy = OrtBackend(spec, cfg).initial()
    obs = random_obs(spec, 17)
    rng = np.random.default_rng(1)
    eps = np.zeros((17, 3), np.float32) if deterministic else rng.standard_normal((17, 3), dtype=np.float32)
    a, b = torch_policy.run(obs, eps), ort_policy.run(obs, eps)
    assert a.shape == b.shape == (17, 3)
    np.testing.assert_allclose(a, b, atol=1e-5)
    assert np.all(np.abs(a) <= 1.0)


def test_deterministic_action_is_the_squashed_mean_scaled_to_the_bounds():
    base = experiment_spec("mujoco_reach", {})
    spec = dataclasses.replace(base, action=ActionSpec(dtype="float32", shape=(3,), low=-2.0, high=4.0))
    actor = make_actor(spec, SMALL, seed=0)
    obs = {k: torch.from_numpy(v) for k, v in random_obs(spec, 5).items()}
    with torch.no_grad():
        mean, _ = actor.distribution(obs)
        action = actor(obs, torch.zeros(5, 3))
    np.testing.assert_allclose(action.numpy(), (1.0 + 3.0 * torch.tanh(mean)).numpy(), atol=1e-6)


def test_sample_log_prob_matches_a_tanh_transformed_gaussian():
    spec = experiment_spec("mujoco_reach", {})
    actor = make_actor(spec, SMALL, seed=0)
    obs = {k: torch.from_numpy(v) for k, v in random_obs(spec, 6).items()}
    eps = torch.randn(6, 3)
    with torch.no_grad():
        action, log_prob = actor.sample(obs, eps)
        mean, log_std = actor.distribution(obs)
    dist = torch.distributions.TransformedDistribution(
        torch.distributions.Normal(mean, log_std.exp()), [torch.distributions.TanhTransform()]
    )
    pre = mean + log_std.exp() * eps
    expected = dist.log_prob(torch.tanh(pre).clamp(-1 + 1e-6, 1 - 1e-6)).sum(1)
    np.testing.assert_allclose(log_prob.numpy(), expected.numpy(), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(action.numpy(), torch.tanh(pre).numpy(), atol=1e-6)


def test_onnx_initializers_are_named_like_the_state_dict():
    import onnx

    actor = make_actor(image_spec(), SMALL, seed=0)
    model = onnx.load_from_string(export_onnx(actor))
    names = {i.name: tuple(i.dims) for i in model.graph.initializer}
    assert {k: tuple(v.shape) for k, v in state_dict_numpy(actor).items()} == names


def test_encoder_is_reusable_and_refuses_images_too_small_for_the_cnn():
    spec = image_spec()
    encoder = make_encoder(spec, SMALL)
    assert encoder.out_features == 12 + SMALL.cnn_features
    tiny = dataclasses.replace(spec, observation={"image": ArraySpec(dtype="uint8", shape=(6, 6, 3))})
    with pytest.raises(ValueError, match="too small"):
        make_actor(tiny, SMALL)


# ---------------------------------------------------------------- weights format


def test_buckets_split_large_tensors_and_reassemble_exactly():
    rng = np.random.default_rng(0)
    arrays = {
        "big": rng.standard_normal((50, 40)).astype(np.float32),  # 8000 B: several buckets
        "small": rng.standard_normal(7).astype(np.float32),
        "other": rng.standard_normal((3, 3)).astype(np.float32),
    }
    messages = transfer_messages(arrays, version=4, fmt="state_dict", bucket_bytes=1024)
    assert len(messages) > 8
    assert all(sum(a.nbytes for a in m.arrays.values()) <= 1024 for m in messages)
    assembler = WeightsAssembler()
    results = [assembler.add(b"peer", m, current_version=0) for m in messages]
    assert results[:-1] == [None] * (len(messages) - 1)
    update = results[-1]
    assert update is not None and update.version == 4
    for name, value in arrays.items():
        np.testing.assert_array_equal(update.arrays[name], value)


def test_a_missing_bucket_or_an_old_version_is_refused():
    arrays = {f"t{i}": np.ones(100, np.float32) for i in range(6)}
    messages = transfer_messages(arrays, version=2, fmt="state_dict", bucket_bytes=800)
    assembler = WeightsAssembler()
    assembler.add(b"p", messages[0], current_version=0)
    with pytest.raises(WeightsError) as missing:
        assembler.add(b"p", messages[2], current_version=0)
    assert missing.value.code.value == "bad_weights"
    with pytest.raises(WeightsError) as stale:
        assembler.add(b"q", messages[0], current_version=2)
    assert stale.value.code.value == "stale_version"
    assert assembler.add(b"q", messages[1], current_version=2) is None  # rest of it ignored


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(w=np.full((2, 2), np.nan, np.float32)), "NaN or Inf"),
        (lambda a: a.update(w=np.full((2, 2), np.inf, np.float32)), "NaN or Inf"),
        (lambda a: a.update(w=np.zeros((2, 3), np.float32)), "the network needs"),
        (lambda a: a.update(w=np.zeros((2, 2), np.float64)), "the network needs"),
        (lambda a: a.pop("b"), "missing"),
    ],
)
def test_state_dicts_are_checked_for_names_shapes_dtypes_and_finite_values(change, message):
    arrays = {"w": np.zeros((2, 2), np.float32), "b": np.zeros(2, np.float32)}
    expected = {k: (v.dtype.name, v.shape) for k, v in arrays.items()}
    check_state_dict(arrays, expected)
    change(arrays)
    with pytest.raises(WeightsError, match=message):
        check_state_dict(arrays, expected)


# -------------------------------------------------------------------- batching


def test_a_batch_waits_only_for_requests_that_known_peers_have_not_sent_yet():
    from inference.batcher import Arrivals

    arrivals = Arrivals()
    arrivals.arrived(b"lone", 0.0)
    assert arrivals.expected(0.001) == 0  # a lone closed-loop client: nothing to wait for
    arrivals.answered(b"lone")
    arrivals.arrived(b"gw", 0.002)
    arrivals.arrived(b"gw", 0.002)  # a gateway with two workers keeps two in flight
    arrivals.answered(b"gw")
    arrivals.answered(b"gw")
    arrivals.arrived(b"gw", 0.003)
    assert arrivals.expected(0.004) == 2  # lone's next request and gw's second one
    arrivals.arrived(b"lone", 0.004)
    arrivals.arrived(b"gw", 0.004)
    assert arrivals.expected(0.005) == 0
    assert arrivals.expected(10.0) == 0  # silent peers stop counting


# ---------------------------------------------------------------------- config


def test_the_inference_block_validates_and_names_the_field():
    cfg = from_dict({"inference": {"enabled": True, "replicas": 2, "network": {"hidden_sizes": [64]}}})
    assert cfg.inference.replicas == 2 and cfg.inference.network.hidden_sizes == (64,)
    for bad, field in [
        ({"replicas": 0}, "inference.replicas"),
        ({"providers": ["NopeExecutionProvider"]}, "inference.providers"),
        ({"device": "tpu"}, "inference.device"),
        ({"network": {"activation": "swish"}}, "inference.network.activation"),
        ({"weights": "model.bin"}, "inference.weights"),
        ({"heartbeat_s": 2.0}, "inference.replica_timeout_s"),
    ]:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            from_dict({"inference": bad})
    assert math.isclose(from_dict({}).inference.deadline_ms, 1000.0)
    assert from_dict({}).inference.enabled is False


@pytest.mark.parametrize(
    "options",
    [{}, {"camera": True, "image_height": 64, "image_width": 48}],
    ids=["state", "camera"],
)
def test_a_torch_server_starts_without_torchs_compiler_stack(options):
    """The server builds each next version's skeleton on the meta device at start-up; the
    actor's bounds arithmetic there, and a CNN encoder sizing itself with a forward pass,
    used to import ``torch._dynamo`` (about a second of start-up before the first action).
    A fresh interpreter, as a server starts."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from gateway.factory import experiment_spec\n"
        "from inference.backends import TorchBackend\n"
        "from inference.config import InferenceConfig\n"
        "from networks.config import NetworkConfig\n"
        f"backend = TorchBackend(experiment_spec('mujoco_reach', {options!r}),\n"
        "    InferenceConfig(backend='torch', network=NetworkConfig(hidden_sizes=(32, 32))))\n"
        "policy = backend.from_state_dict({k: v.numpy() for k, v in backend.template.state_dict().items()}, 1)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("shape", "channels"),
    [((64, 48, 3), (32, 64, 64)), ((96, 96, 1), (16, 32)), ((37, 53, 4), (8,)), ((52, 52, 3), (8, 8, 8, 8))],
)
def test_an_image_encoder_sized_by_arithmetic_fits_what_its_convolutions_give(shape, channels):
    """The projection's input size comes from the conv arithmetic; a real forward pass on
    the CPU gives exactly that many features, and the encoder runs end to end."""
    from networks.modules import ImageEncoder

    config = NetworkConfig(hidden_sizes=(16,), cnn_channels=channels, cnn_features=8)
    encoder = ImageEncoder(shape, config)
    images = torch.zeros(2, *shape, dtype=torch.uint8)
    with torch.no_grad():
        convolved = encoder.convs(images.permute(0, 3, 1, 2).float())
        assert convolved[0].numel() == encoder.project[0].in_features
        assert encoder(images).shape == (2, 8)


def test_an_image_too_small_for_the_convolutions_is_refused_by_name():
    from networks.modules import ImageEncoder

    with pytest.raises(ValueError, match="36x36 image is too small for 4 conv layers"):
        ImageEncoder((36, 36, 3), NetworkConfig(hidden_sizes=(16,), cnn_channels=(8, 8, 8, 8)))


def test_a_torch_version_runs_on_the_received_arrays_themselves():
    """A host version's parameters are the received arrays (no copy), in eval mode, with the
    network's action bounds; building the next version leaves the serving one as it was."""
    spec = experiment_spec("mujoco_reach", {})
    backend = TorchBackend(spec, InferenceConfig(backend="torch", network=SMALL))
    first = state_dict_numpy(make_actor(spec, SMALL, seed=1))
    policy = backend.from_state_dict(first, 1)
    params = dict(policy.actor.named_parameters())
    assert set(params) == set(first)
    for name, arr in first.items():
        assert np.shares_memory(params[name].detach().numpy(), arr), name
    assert not policy.actor.training
    for name, buf in backend.template.named_buffers():
        assert torch.equal(policy.actor.get_buffer(name), buf), name
    obs = random_obs(spec, 4)
    eps = np.zeros((4, *backend.action_shape), np.float32)
    before = policy.run(obs, eps)
    second = backend.from_state_dict(state_dict_numpy(make_actor(spec, SMALL, seed=2)), 2)
    assert second.actor is not policy.actor
    assert not np.allclose(second.run(obs, eps), before)
    np.testing.assert_array_equal(policy.run(obs, eps), before)
    with torch.inference_mode():
        reference = make_actor(spec, SMALL, seed=1).eval()
        expected = reference({k: torch.from_numpy(v) for k, v in obs.items()}, torch.from_numpy(eps))
    np.testing.assert_allclose(before, expected.numpy(), rtol=1e-6, atol=1e-6)


def test_assigning_a_state_dict_fills_persistent_buffers_and_refuses_other_names():
    from inference.backends import _assign_state

    net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    weight, mean = torch.ones(3, 2), torch.full((3,), 5.0)
    _assign_state(net, {"0.weight": weight, "1.running_mean": mean})
    assert net[0].weight.data_ptr() == weight.data_ptr()
    assert net[1].running_mean is mean
    with pytest.raises(WeightsError, match=r"'0\.nothing'"):
        _assign_state(net, {"0.nothing": weight})
