"""Conformance suite for episode backends: the contract of ``gateway.episode``, as tests.

Every backend (MuJoCo, Gymnasium, Isaac, a ROS 2 robot) proves the same contract by
subclassing :class:`EpisodeBackendConformance` and saying how to build itself::

    class TestMyBackendConformance(EpisodeBackendConformance):
        def make_backend(self, num_envs, seed, *, max_episode_steps=None):
            options = {} if max_episode_steps is None else {"max_episode_steps": max_episode_steps}
            return make_backend("my_backend", num_envs=num_envs, seed=seed, options=options)

Class attributes tune the suite for slow or stochastic backends: ``num_envs``,
``short_episode_steps`` (the limit the autoreset test asks for, so it stays short on
a real robot), ``trajectory_steps`` and ``deterministic`` (a real robot cannot promise
identical trajectories from a seed). Nothing here knows about any simulator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import msgpack
import numpy as np
import pytest

from gateway.episode import AutoresetMode, EnvSpec, EpisodeBackend, Obs

BackendFactory = Callable[..., EpisodeBackend]


def random_actions(spec: EnvSpec, num_envs: int, rng: np.random.Generator) -> np.ndarray:
    """Valid actions for every env; unbounded dimensions are drawn from [-1, 1]."""
    low, high = spec.action.low_array.astype(np.float64), spec.action.high_array.astype(np.float64)
    low = np.where(np.isfinite(low), low, np.where(np.isfinite(high), np.minimum(high, 1.0) - 2.0, -1.0))
    high = np.where(np.isfinite(high), high, low + 2.0)
    shape = (num_envs, *spec.action.shape)
    if spec.action.discrete:
        return rng.integers(low.astype(np.int64), high.astype(np.int64) + 1, size=shape).astype(
            spec.action.dtype
        )
    return rng.uniform(low, high, size=shape).astype(spec.action.dtype)


def assert_batched_info(info: Mapping[str, Any], spec: EnvSpec, num_envs: int) -> None:
    """Every info array has the env dim first; ``final_obs`` is a valid observation batch."""
    assert isinstance(info, Mapping), f"info must be a mapping, got {type(info).__name__}"
    for key, value in info.items():
        if key == "final_obs":
            assert spec.check_observation(value, num_envs) == [], "info['final_obs'] does not match the spec"
        elif isinstance(value, np.ndarray):
            assert value.shape[:1] == (num_envs,), (
                f"info[{key!r}] has shape {value.shape}, not ({num_envs}, ...)"
            )
            assert value.dtype != object, f"info[{key!r}] is an object array"


def assert_same_obs(a: Obs, b: Obs, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: keys differ"
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=f"{what}: observation {key!r} differs")


@pytest.mark.conformance
class EpisodeBackendConformance:
    """Tests every episode backend passes; subclasses supply :meth:`make_backend`."""

    num_envs: ClassVar[int] = 2
    """Envs per backend in these tests."""
    short_episode_steps: ClassVar[int] = 5
    """Episode limit the autoreset test asks for."""
    trajectory_steps: ClassVar[int] = 6
    """Steps compared by the determinism test."""
    deterministic: ClassVar[bool] = True
    """Whether the same seed and actions give the same trajectory (False for real robots)."""

    def make_backend(
        self, num_envs: int, seed: int, *, max_episode_steps: int | None = None
    ) -> EpisodeBackend:
        """A new backend; with ``max_episode_steps``, its episodes must end after that many steps."""
        raise NotImplementedError

    def actions(self, spec: EnvSpec, num_envs: int, rng: np.random.Generator) -> np.ndarray:
        """Valid actions used by the tests; override to keep a real robot in a safe region."""
        return random_actions(spec, num_envs, rng)

    @pytest.fixture
    def open_backend(self) -> Iterator[BackendFactory]:
        """Builds backends and closes every one of them after the test, even when it fails."""
        opened: list[EpisodeBackend] = []

        def build(
            *, num_envs: int | None = None, seed: int = 0, max_episode_steps: int | None = None
        ) -> EpisodeBackend:
            backend = self.make_backend(num_envs or self.num_envs, seed, max_episode_steps=max_episode_steps)
            opened.append(backend)
            return backend

        yield build
        for backend in opened:
            backend.close()

    # ------------------------------------------------------------------- spec

    def test_spec_is_readable_before_reset_and_survives_the_wire(self, open_backend: BackendFactory) -> None:
        backend = open_backend()
        spec = backend.spec
        assert isinstance(spec, EnvSpec)
        assert backend.num_envs == self.num_envs
        assert backend.autoreset_mode == AutoresetMode.SAME_STEP
        assert all(lo <= hi for lo, hi in zip(spec.action.low, spec.action.high))
        decoded = EnvSpec.from_dict(msgpack.unpackb(msgpack.packb(spec.to_dict())))
        assert spec.mismatches(decoded) == []
        assert dict(decoded.metadata) == dict(spec.metadata)
        spec.observation_space()
        spec.action_space()

    def test_reset_returns_every_spec_key_with_env_dim_and_dtype(self, open_backend: BackendFactory) -> None:
        backend = open_backend()
        obs, info = backend.reset(seed=0)
        assert backend.spec.check_observation(obs, self.num_envs) == []
        assert_batched_info(info, backend.spec, self.num_envs)
        obs, info = backend.reset()
        assert backend.spec.check_observation(obs, self.num_envs) == []

    def test_step_returns_batched_reward_flags_and_info(self, open_backend: BackendFactory) -> None:
        backend = open_backend()
        n = self.num_envs
        backend.reset(seed=0)
        rng = np.random.default_rng(0)
        for _ in range(3):
            obs, reward, terminated, truncated, info = backend.step(self.actions(backend.spec, n, rng))
            assert backend.spec.check_observation(obs, n) == []
            assert reward.dtype == np.float32 and reward.shape == (n,)
            assert terminated.dtype == np.bool_ and terminated.shape == (n,)
            assert truncated.dtype == np.bool_ and truncated.shape == (n,)
            assert np.all(np.isfinite(reward))
            assert_batched_info(info, backend.spec, n)

    def test_returned_arrays_are_not_overwritten_by_later_steps(self, open_backend: BackendFactory) -> None:
        # The worker sends observations without copying (ZeroMQ copy=False); a backend
        # that refills the arrays it returned would corrupt messages still in flight.
        backend = open_backend(max_episode_steps=2)
        rng = np.random.default_rng(3)
        obs, _ = backend.reset(seed=0)
        kept = [{k: v.copy() for k, v in obs.items()}]
        returned = [obs]
        for _ in range(3):
            obs = backend.step(self.actions(backend.spec, self.num_envs, rng))[0]
            returned.append(obs)
            kept.append({k: v.copy() for k, v in obs.items()})
        for t, (now, then) in enumerate(zip(returned, kept)):
            assert_same_obs(now, then, f"observation returned at call {t}, after later steps")

    # ---------------------------------------------------------------- actions

    def _assert_refused_then_works(self, backend: EpisodeBackend, bad: np.ndarray, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            backend.step(bad)
        rng = np.random.default_rng(1)
        obs, *_ = backend.step(self.actions(backend.spec, self.num_envs, rng))
        assert backend.spec.check_observation(obs, self.num_envs) == []

    def test_action_batch_of_wrong_size_is_refused_and_backend_survives(
        self, open_backend: BackendFactory
    ) -> None:
        backend = open_backend()
        backend.reset(seed=0)
        good = self.actions(backend.spec, self.num_envs + 1, np.random.default_rng(0))
        self._assert_refused_then_works(backend, good, r"action.*\[")

    def test_action_of_wrong_shape_is_refused_and_backend_survives(
        self, open_backend: BackendFactory
    ) -> None:
        backend = open_backend()
        backend.reset(seed=0)
        good = self.actions(backend.spec, self.num_envs, np.random.default_rng(0))
        self._assert_refused_then_works(backend, good[..., None], r"action.*\[")

    def test_action_of_wrong_dtype_is_refused_and_backend_survives(
        self, open_backend: BackendFactory
    ) -> None:
        backend = open_backend()
        backend.reset(seed=0)
        good = self.actions(backend.spec, self.num_envs, np.random.default_rng(0))
        wrong = np.float64 if np.dtype(backend.spec.action.dtype) != np.float64 else np.float32
        self._assert_refused_then_works(backend, good.astype(wrong), r"action.*" + np.dtype(wrong).name)

    def test_nan_action_is_refused_and_backend_survives(self, open_backend: BackendFactory) -> None:
        backend = open_backend()
        if backend.spec.action.discrete:
            pytest.skip("integer actions cannot be NaN")
        backend.reset(seed=0)
        bad = self.actions(backend.spec, self.num_envs, np.random.default_rng(0))
        bad.reshape(self.num_envs, -1)[0, 0] = np.nan
        self._assert_refused_then_works(backend, bad, r"(?i)nan")

    # ---------------------------------------------------------------- seeding

    def test_same_seed_gives_same_reset_and_trajectory(self, open_backend: BackendFactory) -> None:
        if not self.deterministic:
            pytest.skip("backend is not deterministic")
        first, second = open_backend(seed=3), open_backend(seed=3)
        obs_a, _ = first.reset(seed=11)
        obs_b, _ = second.reset(seed=11)
        assert_same_obs(obs_a, obs_b, "reset with the same seed")
        rng = np.random.default_rng(5)
        for t in range(self.trajectory_steps):
            action = self.actions(first.spec, self.num_envs, rng)
            step_a, step_b = first.step(action), second.step(action.copy())
            assert_same_obs(step_a[0], step_b[0], f"step {t}")
            for name, a, b in zip(("reward", "terminated", "truncated"), step_a[1:4], step_b[1:4]):
                np.testing.assert_array_equal(a, b, err_msg=f"step {t}: {name} differs")
        again, _ = first.reset(seed=11)
        assert_same_obs(obs_a, again, "a second reset with the same seed")

    def test_constructor_seed_decides_the_first_unseeded_reset(self, open_backend: BackendFactory) -> None:
        if not self.deterministic:
            pytest.skip("backend is not deterministic")
        obs_a, _ = open_backend(seed=4).reset()
        obs_b, _ = open_backend(seed=4).reset()
        assert_same_obs(obs_a, obs_b, "first reset of two backends built with the same seed")

    # -------------------------------------------------------------- autoreset

    def test_truncation_at_the_limit_resets_in_the_same_step(self, open_backend: BackendFactory) -> None:
        limit = self.short_episode_steps
        backend = open_backend(max_episode_steps=limit)
        assert backend.spec.max_episode_steps == limit
        n = self.num_envs
        obs, _ = backend.reset(seed=0)
        rng = np.random.default_rng(2)
        age = np.zeros(n, dtype=np.int64)
        truncations = 0
        for t in range(2 * limit + 1):
            obs, _, terminated, truncated, info = backend.step(self.actions(backend.spec, n, rng))
            age += 1
            assert not np.any(truncated & (age < limit)), f"step {t}: truncated before the limit, ages {age}"
            assert np.all(truncated | terminated | (age < limit)), f"step {t}: no truncation at the limit"
            done = terminated | truncated
            if not backend.provides_final_obs:
                # No terminal observation exists (Isaac Lab's autoreset): nothing may pose as one.
                assert "final_obs" not in info, f"step {t}: final_obs set by a backend that provides none"
                truncations += int(np.count_nonzero(truncated))
                age[done] = 0
                continue
            if not done.any():
                assert "final_obs" not in info or backend.spec.check_observation(info["final_obs"], n) == []
                continue
            final = info.get("final_obs")
            assert final is not None, f"step {t}: an episode ended without info['final_obs']"
            assert backend.spec.check_observation(final, n) == []
            for i in np.flatnonzero(done):
                assert any(not np.array_equal(final[k][i], obs[k][i]) for k in obs), (
                    f"step {t}: env {i}'s returned observation is still its final one, not a fresh episode"
                )
            assert all(final[k] is not obs[k] for k in obs), "final_obs shares arrays with obs"
            truncations += int(np.count_nonzero(truncated))
            age[done] = 0
        assert truncations >= n, "no env reached the episode limit"

    # --------------------------------------------------------------- lifetime

    def test_close_is_idempotent(self, open_backend: BackendFactory) -> None:
        backend = open_backend()
        backend.reset(seed=0)
        backend.close()
        backend.close()

    def test_backend_is_a_context_manager(self) -> None:
        with self.make_backend(self.num_envs, 0) as backend:
            obs, _ = backend.reset(seed=0)
            assert backend.spec.check_observation(obs, self.num_envs) == []
