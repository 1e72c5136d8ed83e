"""Conformance suite for inference backends: the contract of ``inference.backends.Backend``.

A backend builds one :class:`~inference.backends.LoadedPolicy` per weights version; the
inference server serves one, keeps the previous, and swaps a new one in only when the
backend accepted it. So every backend must give actions of the spec's shape within its
bounds, be a pure function of (observations, noise) so that zero noise is the
deterministic action, load state dicts and ONNX models made by ``networks.modules`` to
the torch actor's own actions under the version asked for, and refuse bad weights
with a ``WeightsError`` naming the problem while the versions already built keep
serving. A backend proves it by subclassing :class:`InferenceBackendConformance` and
naming itself::

    class TestMyBackendConformance(InferenceBackendConformance):
        backend = "my_runtime"
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from gateway.episode import EnvSpec
from gateway.factory import experiment_spec
from inference.backends import Backend, LoadedPolicy, make_backend
from inference.config import InferenceConfig
from inference.weights import WeightsError
from networks.modules import NetworkConfig, export_onnx, make_actor, state_dict_numpy

SPEC = experiment_spec("mujoco_reach", {})
NETWORK = NetworkConfig(hidden_sizes=(16, 16))


def batch(spec: EnvSpec, n: int, seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    obs = {k: rng.standard_normal((n, *a.shape)).astype(a.dtype) for k, a in spec.observation.items()}
    eps = rng.standard_normal((n, *spec.action.shape)).astype(np.float32)
    return obs, eps


def reference(actor: Any, obs: dict[str, np.ndarray], eps: np.ndarray) -> np.ndarray:
    """The torch actor's own actions: what every backend must reproduce."""
    with torch.inference_mode():
        out = actor({k: torch.from_numpy(v) for k, v in obs.items()}, torch.from_numpy(eps))
    return np.asarray(out.numpy())


def _shape(arrays: dict[str, np.ndarray]) -> None:
    arrays["trunk.0.weight"] = np.zeros((3, 3), np.float32)


def _nan(arrays: dict[str, np.ndarray]) -> None:
    arrays["trunk.0.weight"] = arrays["trunk.0.weight"].copy()
    arrays["trunk.0.weight"][0, 0] = np.nan


def _inf(arrays: dict[str, np.ndarray]) -> None:
    arrays["head.bias"] = np.full_like(arrays["head.bias"], np.inf)


def _dtype(arrays: dict[str, np.ndarray]) -> None:
    arrays["head.weight"] = arrays["head.weight"].astype(np.float64)


def _missing(arrays: dict[str, np.ndarray]) -> None:
    del arrays["head.bias"]


def _extra(arrays: dict[str, np.ndarray]) -> None:
    arrays["spare.weight"] = np.zeros(4, np.float32)


BAD_STATE_DICTS: dict[str, tuple[Callable[[dict[str, np.ndarray]], None], str]] = {
    "wrong_shape": (_shape, "trunk.0.weight"),
    "nan": (_nan, "NaN"),
    "inf": (_inf, "head.bias"),
    "wrong_dtype": (_dtype, "head.weight"),
    "missing_tensor": (_missing, "head.bias"),
    "unexpected_tensor": (_extra, "spare.weight"),
}
"""A bad state dict, and a word its refusal must name."""


@pytest.mark.conformance
class InferenceBackendConformance:
    """Tests every inference backend passes; subclasses name ``backend``."""

    backend: ClassVar[str]
    """``inference.backend`` in the config."""
    spec: ClassVar[EnvSpec] = SPEC
    tolerance: ClassVar[float] = 1e-5
    """Largest difference from the torch actor's actions."""

    def make(self, **config: Any) -> Backend:
        return make_backend(
            self.spec,
            InferenceConfig(backend=self.backend, device="cpu", network=NETWORK, **config),
        )

    @pytest.fixture
    def built(self) -> tuple[Backend, LoadedPolicy]:
        backend = self.make(init_seed=3, initial_version=4)
        return backend, backend.initial()

    def assert_actions(self, policy: LoadedPolicy, n: int, seed: int) -> np.ndarray:
        obs, eps = batch(self.spec, n, seed)
        out = policy.run(obs, eps)
        action = self.spec.action
        assert out.shape == (n, *action.shape), f"actions {out.shape}, spec {action.shape}"
        assert out.dtype == np.float32
        assert np.all(np.isfinite(out))
        assert np.all(out >= action.low_array) and np.all(out <= action.high_array), "outside the bounds"
        return out

    # ---------------------------------------------------------------- tests

    def test_actions_have_the_spec_shape_and_stay_within_bounds(self, built) -> None:
        _, policy = built
        for n in (1, 7):
            self.assert_actions(policy, n, seed=n)
        obs, eps = batch(self.spec, 5, seed=1)
        huge = {k: v * 1e4 for k, v in obs.items()}
        out = policy.run(huge, eps * 50)
        assert np.all(out >= self.spec.action.low_array) and np.all(out <= self.spec.action.high_array)

    def test_the_initial_version_is_the_seeded_actor_under_the_configured_version(self, built) -> None:
        _, policy = built
        assert policy.version == 4
        obs, eps = batch(self.spec, 6, seed=2)
        actor = make_actor(self.spec, NETWORK, seed=3)
        np.testing.assert_allclose(policy.run(obs, eps), reference(actor, obs, eps), atol=self.tolerance)

    def test_zero_noise_is_deterministic_and_noise_is_used(self, built) -> None:
        _, policy = built
        obs, eps = batch(self.spec, 6, seed=3)
        zero = np.zeros_like(eps)
        first, second = policy.run(obs, zero), policy.run(obs, zero.copy())
        np.testing.assert_array_equal(first, second)
        np.testing.assert_array_equal(policy.run(obs, eps), policy.run(obs, eps.copy()))
        assert not np.allclose(policy.run(obs, eps), first), "the noise does not change the actions"
        single = policy.run({k: v[2:3] for k, v in obs.items()}, zero[2:3])
        np.testing.assert_allclose(single, first[2:3], atol=self.tolerance)

    @pytest.mark.parametrize("fmt", ["state_dict", "onnx"])
    def test_new_weights_change_the_actions_and_carry_their_version(self, built, fmt) -> None:
        backend, old = built
        obs, eps = batch(self.spec, 5, seed=4)
        before = old.run(obs, eps)
        actor = make_actor(self.spec, NETWORK, seed=21)
        if fmt == "onnx":
            new = backend.from_onnx(np.frombuffer(export_onnx(actor), np.uint8), 9)
        else:
            new = backend.from_state_dict(state_dict_numpy(actor), 9)
        assert new.version == 9 and old.version == 4
        after = new.run(obs, eps)
        assert not np.allclose(after, before), "new weights gave the old actions"
        np.testing.assert_allclose(after, reference(actor, obs, eps), atol=self.tolerance)
        np.testing.assert_array_equal(old.run(obs, eps), before)  # the previous version, for rollback

    @pytest.mark.parametrize("kind", list(BAD_STATE_DICTS))
    def test_a_bad_state_dict_is_refused_naming_it_and_the_old_weights_keep_serving(
        self, built, kind
    ) -> None:
        backend, old = built
        obs, eps = batch(self.spec, 3, seed=5)
        before = old.run(obs, eps)
        arrays = state_dict_numpy(make_actor(self.spec, NETWORK, seed=22))
        change, word = BAD_STATE_DICTS[kind]
        change(arrays)
        with pytest.raises(WeightsError) as refused:
            backend.from_state_dict(arrays, 10)
        assert refused.value.code.value == "bad_weights"
        assert word in refused.value.message, refused.value.message
        np.testing.assert_array_equal(old.run(obs, eps), before)
        good = make_actor(self.spec, NETWORK, seed=23)
        fresh = backend.from_state_dict(state_dict_numpy(good), 11)
        np.testing.assert_allclose(fresh.run(obs, eps), reference(good, obs, eps), atol=self.tolerance)

    @pytest.mark.parametrize("kind", ["truncated", "garbage", "other_spec", "nan"])
    def test_a_bad_onnx_model_is_refused_and_later_weights_still_load(self, built, kind) -> None:
        backend, old = built
        obs, eps = batch(self.spec, 3, seed=6)
        before = old.run(obs, eps)
        # The serving graph came over the wire as ONNX, at the version the bad one reuses
        # (a publication after a rollback).
        served = backend.from_onnx(
            np.frombuffer(export_onnx(make_actor(self.spec, NETWORK, seed=24)), np.uint8), 12
        )
        blob = export_onnx(make_actor(self.spec, NETWORK, seed=25))
        if kind == "truncated":
            bad = blob[: len(blob) // 2]
        elif kind == "garbage":
            bad = bytes(range(256)) * 8
        elif kind == "nan":
            actor = make_actor(self.spec, NETWORK, seed=25)
            with torch.no_grad():
                actor.head.bias.fill_(float("nan"))
            bad = export_onnx(actor)
        else:
            other = _other_spec(self.spec)
            bad = export_onnx(make_actor(other, NETWORK, seed=25))
        with pytest.raises(WeightsError) as refused:
            backend.from_onnx(np.frombuffer(bad, np.uint8), 12)
        assert refused.value.code.value == "bad_weights" and refused.value.message
        np.testing.assert_array_equal(old.run(obs, eps), before)
        served.run(obs, eps)
        good = make_actor(self.spec, NETWORK, seed=26)
        fresh = backend.from_state_dict(state_dict_numpy(good), 13)
        np.testing.assert_allclose(fresh.run(obs, eps), reference(good, obs, eps), atol=self.tolerance)


def _other_spec(spec: EnvSpec) -> EnvSpec:
    """The same env with one more value in its first observation: a model made for it does not fit."""
    from dataclasses import replace

    key, first = next(iter(spec.observation.items()))
    wider = replace(first, shape=(first.shape[0] + 1, *first.shape[1:]))
    return replace(spec, observation={**spec.observation, key: wider})
