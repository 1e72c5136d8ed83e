"""Conformance suite for action sources: the contract of ``gateway.policies.ActionSource``.

The gateway submits a batch of observations with a key and a deadline and collects
``(key, actions, versions, error)`` from :meth:`~gateway.policies.ActionSource.results`;
an in-process policy and a fleet of inference servers must look the same to it. A
source proves it by subclassing :class:`ActionSourceConformance`::

    class TestMySourceConformance(ActionSourceConformance):
        stochastic = False
        @pytest.fixture
        def source(self):
            src = MySource(SPEC)
            yield src
            src.close()

Class attributes say what the source promises: ``stochastic`` (rows not flagged
deterministic are sampled, so the same observations give other actions) and
``honours_deterministic_rows`` (rows flagged deterministic get the same action for the
same observation). A source whose weights can be swapped in a test overrides
:meth:`publish_new_version`.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import numpy as np
import pytest

from gateway.episode import EnvSpec, Obs
from gateway.policies import ActionSource
from tests.conftest import time_left, wait_for

Result = tuple[Any, np.ndarray | None, np.ndarray | None, str | None]


def random_obs(spec: EnvSpec, n: int, seed: int, *, read_only: bool = False) -> Obs:
    """Observations for ``n`` envs; ``read_only`` gives views like the ones the codec decodes."""
    rng = np.random.default_rng(seed)
    obs = {}
    for key, a in spec.observation.items():
        value = rng.standard_normal((n, *a.shape)).astype(a.dtype)
        if read_only:
            value = np.frombuffer(value.tobytes(), dtype=value.dtype).reshape(value.shape)
        obs[key] = value
    return obs


@pytest.mark.conformance
class ActionSourceConformance:
    """Tests every action source passes; subclasses supply ``spec`` and the ``source`` fixture."""

    spec: ClassVar[EnvSpec]
    """The experiment's spec the source acts for."""
    stochastic: ClassVar[bool] = False
    """Whether rows not flagged deterministic are sampled (other actions for the same obs)."""
    honours_deterministic_rows: ClassVar[bool] = True
    """Whether rows flagged deterministic get the same action for the same observation."""
    deadline_s: ClassVar[float] = 10.0
    """Deadline given to ordinary requests."""

    @pytest.fixture
    def source(self) -> ActionSource:
        raise NotImplementedError

    def publish_new_version(self, source: ActionSource) -> int | None:
        """Make the source serve newer weights and return their version; None if it cannot."""
        return None

    # ------------------------------------------------------------- helpers

    @staticmethod
    def collect(source: ActionSource, keys: list[Any]) -> dict[Any, Result]:
        """Tick and read results as the gateway loop does until every key is answered once."""
        got: dict[Any, Result] = {}

        def done() -> bool:
            source.tick()
            for result in source.results():
                assert result[0] in keys, f"an answer for a key never submitted: {result[0]!r}"
                assert result[0] not in got, f"key {result[0]!r} answered twice"
                got[result[0]] = result
            return len(got) == len(keys)

        wait_for(done, timeout=time_left(), interval=0.002, what=f"answers for {keys}")
        return got

    def ask(self, source: ActionSource, obs: Obs, deterministic: np.ndarray | None = None) -> Result:
        key = object()
        source.submit(key, obs, time.monotonic() + self.deadline_s, deterministic)
        return self.collect(source, [key])[key]

    def assert_fits_the_spec(self, result: Result, n: int, source: ActionSource) -> None:
        _, actions, versions, error = result
        assert error is None, f"the source answered an error: {error}"
        assert actions is not None and versions is not None
        action = self.spec.action
        assert actions.shape == (n, *action.shape), f"actions {actions.shape}, spec {action.shape}"
        assert actions.dtype == np.dtype(action.dtype), f"actions {actions.dtype}, spec {action.dtype}"
        assert np.all(np.isfinite(actions))
        low, high = action.low_array, action.high_array
        assert np.all(actions >= low) and np.all(actions <= high), "actions outside the spec's bounds"
        assert versions.shape == (n,) and versions.dtype == np.int64
        assert np.all(versions == source.version), (
            f"versions {versions} but the source serves {source.version}"
        )

    # ---------------------------------------------------------------- tests

    def test_every_submission_is_answered_once_with_actions_that_fit_the_spec(self, source) -> None:
        sizes = {"a": 1, "b": 3, "c": 5}
        deadline = time.monotonic() + self.deadline_s
        for i, (key, n) in enumerate(sizes.items()):
            source.submit(key, random_obs(self.spec, n, seed=i), deadline)
        answers = self.collect(source, list(sizes))
        for key, n in sizes.items():
            self.assert_fits_the_spec(answers[key], n, source)
        source.tick()
        assert source.results() == [], "answers arrived after every key was answered"

    def test_read_only_observations_are_accepted(self, source) -> None:
        result = self.ask(source, random_obs(self.spec, 4, seed=9, read_only=True))
        self.assert_fits_the_spec(result, 4, source)

    def test_rows_flagged_deterministic_get_the_same_action_for_the_same_observation(self, source) -> None:
        if not self.honours_deterministic_rows:
            pytest.skip("this source documents that it ignores the deterministic flags")
        obs = random_obs(self.spec, 4, seed=3)
        flags = np.array([True, False, True, False])
        first, second = self.ask(source, obs, flags), self.ask(source, obs, flags)
        self.assert_fits_the_spec(first, 4, source)
        assert first[1] is not None and second[1] is not None
        np.testing.assert_array_equal(first[1][flags], second[1][flags])
        every = self.ask(source, obs, np.ones(4, bool))
        assert every[1] is not None
        np.testing.assert_array_equal(every[1][flags], first[1][flags])

    def test_unflagged_rows_are_sampled_only_by_a_stochastic_source(self, source) -> None:
        obs = random_obs(self.spec, 4, seed=4)
        first, second = self.ask(source, obs), self.ask(source, obs)
        assert first[1] is not None and second[1] is not None
        if self.stochastic:
            assert not np.allclose(first[1], second[1]), "a stochastic source gave the same actions twice"
        else:
            np.testing.assert_array_equal(first[1], second[1], err_msg="a deterministic source varied")

    def test_a_deadline_already_past_ends_in_an_error_not_a_hang(self, source) -> None:
        self.ask(source, random_obs(self.spec, 1, seed=5))  # a source that is up and serving
        key = "late"
        source.submit(key, random_obs(self.spec, 2, seed=5), time.monotonic() - 1.0)
        _, actions, versions, error = self.collect(source, [key])[key]
        assert actions is None and versions is None, "a request past its deadline was given actions"
        assert isinstance(error, str) and "deadline" in error, error
        self.assert_fits_the_spec(self.ask(source, random_obs(self.spec, 2, seed=6)), 2, source)

    def test_the_version_is_reported_and_a_new_one_is_served_after_a_swap(self, source) -> None:
        before = source.version
        assert isinstance(before, int) and before >= 0
        self.assert_fits_the_spec(self.ask(source, random_obs(self.spec, 2, seed=7)), 2, source)
        new = self.publish_new_version(source)
        if new is None:
            assert source.version == before, "the version changed with nothing published"
            return
        assert new > before

        def serves_new() -> bool:
            versions = self.ask(source, random_obs(self.spec, 2, seed=8))[2]
            return versions is not None and bool(np.all(versions == new))

        wait_for(serves_new, timeout=time_left(), what=f"answers from version {new}")
        assert source.version == new

    def test_close_is_idempotent(self, source) -> None:
        self.ask(source, random_obs(self.spec, 1, seed=1))
        source.close()
        source.close()
