"""The ``gymnasium`` backend: conformance on classic envs and the space-to-spec mapping."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import gymnasium
import numpy as np
import pytest
from gymnasium import spaces

from gateway.config import ConfigError
from gateway.episode import ArraySpec, EpisodeBackend
from gateway.factory import make_backend
from sim_bridges.gymnasium import action_spec, observation_specs
from tests.conformance.episode_backend import EpisodeBackendConformance


class GymnasiumConformance(EpisodeBackendConformance):
    env_id: ClassVar[str]
    vectorization: ClassVar[str] = "sync"

    def make_backend(
        self, num_envs: int, seed: int, *, max_episode_steps: int | None = None
    ) -> EpisodeBackend:
        options: dict[str, Any] = {"id": self.env_id, "vectorization": self.vectorization}
        if max_episode_steps is not None:
            options["max_episode_steps"] = max_episode_steps
        backend: EpisodeBackend = make_backend("gymnasium", num_envs=num_envs, seed=seed, options=options)
        return backend


class TestPendulumSingleConformance(GymnasiumConformance):
    env_id = "Pendulum-v1"
    num_envs = 1


class TestPendulumSyncVectorConformance(GymnasiumConformance):
    env_id = "Pendulum-v1"
    num_envs = 3


class TestPendulumAsyncVectorConformance(GymnasiumConformance):
    env_id = "Pendulum-v1"
    vectorization = "async"


class TestCartPoleSingleConformance(GymnasiumConformance):
    env_id = "CartPole-v1"
    num_envs = 1


class TestCartPoleSyncVectorConformance(GymnasiumConformance):
    env_id = "CartPole-v1"


class TestReachDictObservationConformance(GymnasiumConformance):
    env_id = "loopgate/Reach-v0"


def gym_backend(num_envs: int = 1, **options: Any) -> EpisodeBackend:
    backend: EpisodeBackend = make_backend("gymnasium", num_envs=num_envs, seed=0, options=options)
    return backend


@pytest.mark.unit
def test_spec_comes_from_the_spaces_metadata_and_registration() -> None:
    with gym_backend(id="CartPole-v1") as backend:
        spec = backend.spec
        assert spec.name == "CartPole-v1" and spec.control_hz == 50 and spec.max_episode_steps == 500
        assert spec.observation == {"obs": ArraySpec(dtype="float32", shape=(4,))}
        assert (spec.action.dtype, spec.action.shape, spec.action.low, spec.action.high) == (
            "int64",
            (),
            (0.0,),
            (1.0,),
        )
    with gym_backend(id="Pendulum-v1", control_hz=10.0, max_episode_steps=7) as backend:
        assert backend.spec.control_hz == 10.0 and backend.spec.max_episode_steps == 7
        assert backend.spec.action.low == (-2.0,) and backend.spec.action.dtype == "float32"


@pytest.mark.unit
def test_space_mapping_covers_discrete_offsets_unbounded_boxes_and_dicts() -> None:
    assert action_spec(spaces.Discrete(3, start=-1), "x").low == (-1.0,)
    assert action_spec(spaces.Discrete(3, start=-1), "x").high == (1.0,)
    unbounded = action_spec(spaces.Box(-np.inf, np.inf, shape=(2,), dtype=np.float64), "x")
    assert (
        unbounded.dtype == "float64"
        and unbounded.low == (-np.inf, -np.inf)
        and unbounded.high == (np.inf, np.inf)
    )
    multi = action_spec(spaces.MultiDiscrete([2, 5], start=[0, 1]), "x")
    assert (multi.shape, multi.low, multi.high) == ((2,), (0.0, 1.0), (1.0, 5.0))
    obs = observation_specs(spaces.Dict({"a": spaces.Box(0, 1, (2,)), "b": spaces.Discrete(4)}), "x")
    assert obs == {"a": ArraySpec(dtype="float32", shape=(2,)), "b": ArraySpec(dtype="int64", shape=())}


@pytest.mark.unit
@pytest.mark.parametrize(
    ("space", "where"),
    [
        (spaces.Tuple([spaces.Discrete(2)]), "observation space Tuple"),
        (spaces.Text(5), "observation space Text"),
        (spaces.Dict({"inner": spaces.Dict({"x": spaces.Discrete(2)})}), "observation 'inner' space Dict"),
    ],
)
def test_unsupported_observation_space_is_refused_naming_env_and_space(
    space: spaces.Space[Any], where: str
) -> None:
    with pytest.raises(ValueError, match=f"MyEnv-v0: {where}"):
        observation_specs(space, "MyEnv-v0")


@pytest.mark.unit
def test_unsupported_action_space_is_refused() -> None:
    with pytest.raises(ValueError, match="MyEnv-v0: action space Tuple"):
        action_spec(spaces.Tuple([spaces.Discrete(2), spaces.Discrete(2)]), "MyEnv-v0")


@pytest.mark.unit
def test_registered_env_with_a_tuple_observation_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"Blackjack-v1: observation space Tuple"):
        gym_backend(id="Blackjack-v1", max_episode_steps=10)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"id": "CartPol-v1"}, r"env.options.id: unknown Gymnasium id 'CartPol-v1'.*CartPole"),
        (
            {"id": "no_such_module:Foo-v0"},
            r"env.options.id 'no_such_module:Foo-v0' cannot be imported: no module 'no_such_module' "
            r"among the installed packages or in .* \(the folder loopgate was started in\)",
        ),
        ({"id": "CartPole-v1", "vectorization": "threads"}, r"env.options.vectorization"),
        ({"id": "CartPole-v1", "max_episode_steps": 0}, r"env.options.max_episode_steps"),
        ({"kwargs": {}}, r"env.options.*id"),
    ],
)
def test_bad_options_are_refused_naming_the_field(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        gym_backend(**options)


USER_ENV = """
import gymnasium as gym
import numpy as np

from loopgate_user_helpers import BOUND  # a sibling module of the user's, found the same way


class Thing(gym.Env):
    metadata = {"render_fps": 50}
    observation_space = gym.spaces.Box(-BOUND, BOUND, (3,), np.float64)
    action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(3), {}

    def step(self, action):
        return np.zeros(3), 0.0, False, False, {}


gym.register("LoopgateUserThing-v0", entry_point=Thing, max_episode_steps=10)
"""


@pytest.fixture
def start_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``tmp_path`` as the folder loopgate was started in; the user's modules and env ids
    it registers are forgotten afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    yield tmp_path
    for name in ("loopgate_user_envs", "loopgate_user_helpers", "loopgate_user_broken"):
        sys.modules.pop(name, None)
    gymnasium.registry.pop("LoopgateUserThing-v0", None)


@pytest.mark.unit
def test_an_env_module_in_the_start_folder_is_found_after_every_package(start_folder: Path) -> None:
    """As a script in that folder would find it (with its sibling modules)."""
    (start_folder / "loopgate_user_envs.py").write_text(USER_ENV)
    (start_folder / "loopgate_user_helpers.py").write_text("BOUND = 2.0\n")
    with gym_backend(id="loopgate_user_envs:LoopgateUserThing-v0") as backend:
        assert backend.spec.observation == {"obs": ArraySpec(dtype="float64", shape=(3,))}
        backend.reset(seed=0)
    assert sys.modules["loopgate_user_envs"].__file__ == str(start_folder / "loopgate_user_envs.py")


@pytest.mark.unit
def test_an_env_module_that_imports_a_missing_package_names_that_package(start_folder: Path) -> None:
    (start_folder / "loopgate_user_broken.py").write_text("import loopgate_not_installed_anywhere\n")
    with pytest.raises(ConfigError, match=r"missing Python package 'loopgate_not_installed_anywhere'"):
        gym_backend(id="loopgate_user_broken:Foo-v0")


class BareEnv(gymnasium.Env[np.ndarray, np.ndarray]):
    """No render_fps, and registered without an episode limit."""

    observation_space = spaces.Box(-1, 1, (2,), np.float32)
    action_space = spaces.Box(-1, 1, (1,), np.float32)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        return np.zeros(2, np.float32), 0.0, False, False, {}


BARE_ID = "loopgate-tests/Bare-v0"
if BARE_ID not in gymnasium.registry:
    gymnasium.register(id=BARE_ID, entry_point="tests.test_sim_gymnasium:BareEnv")


@pytest.mark.unit
def test_env_without_a_rate_or_limit_needs_them_in_the_config() -> None:
    with pytest.raises(ValueError, match=r"env.options.control_hz"):
        gym_backend(id=BARE_ID)
    with pytest.raises(ValueError, match=r"env.options.max_episode_steps"):
        gym_backend(id=BARE_ID, control_hz=10.0)
    with gym_backend(id=BARE_ID, control_hz=10.0, max_episode_steps=3) as backend:
        assert backend.spec.control_hz == 10.0 and backend.spec.max_episode_steps == 3


@pytest.mark.unit
def test_discrete_action_out_of_range_is_refused_and_backend_survives() -> None:
    with gym_backend(2, id="CartPole-v1") as backend:
        backend.reset(seed=0)
        with pytest.raises(ValueError, match="outside"):
            backend.step(np.array([0, 2], np.int64))
        obs, *_ = backend.step(np.array([0, 1], np.int64))
        assert obs["obs"].shape == (2, 4)


@pytest.mark.unit
@pytest.mark.parametrize("num_envs", [1, 2])
def test_info_of_a_finished_env_describes_its_last_step_not_the_reset(num_envs: int) -> None:
    with gym_backend(num_envs, id="loopgate/Reach-v0", max_episode_steps=2) as backend:
        backend.reset(seed=0)
        for _ in range(2):
            _, reward, _, truncated, info = backend.step(np.ones((num_envs, 3), np.float32))
        assert truncated.all()
        final = info["final_obs"]
        np.testing.assert_allclose(info["distance"], np.hypot(*final["target_rel"].T), atol=1e-6)
        np.testing.assert_allclose(reward, -info["distance"], atol=1e-6)
        assert info["success"].dtype == np.bool_ and info["success"].shape == (num_envs,)


@pytest.mark.unit
def test_reset_seed_seeds_env_i_with_seed_plus_i() -> None:
    with gym_backend(3, id="Pendulum-v1") as vector, gym_backend(1, id="Pendulum-v1") as single:
        batch, _ = vector.reset(seed=10)
        for i in range(3):
            obs, _ = single.reset(seed=10 + i)
            np.testing.assert_array_equal(batch["obs"][i], obs["obs"][0])


@pytest.mark.unit
def test_an_env_without_a_success_signal_says_so_in_its_spec_and_evaluations() -> None:
    from gateway.evaluation import Evaluator

    with gym_backend(1, id="Pendulum-v1") as pendulum, gym_backend(1, id="loopgate/Reach-v0") as reach:
        assert pendulum.spec.metadata["success_signal"] is False
        assert reach.spec.metadata["success_signal"] is True  # declared in the env's metadata
    evaluator = Evaluator()
    evaluator.success_signal = False
    evaluator.request(1, env_steps=0)
    evaluator.new_episode("w", 0, 1)
    one = np.array([0])
    evaluator.steps("w", one, np.array([-1.0]), np.array([0.0]), one, np.array([True]), 1)
    last = evaluator.status()["last"]
    assert last["success_rate"] is None and last["return_mean"] == -1.0  # unknown, not 0 %


@pytest.mark.unit
def test_success_key_maps_an_envs_own_success_info() -> None:
    with gym_backend(2, id="loopgate/Reach-v0", success_key="distance") as backend:
        backend.reset(seed=0)
        _, _, _, _, info = backend.step(np.zeros((2, 3), np.float32))
        assert info["success"].dtype == np.bool_
        np.testing.assert_array_equal(info["success"], info["distance"].astype(bool))
