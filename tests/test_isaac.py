"""The Isaac Lab adapter against Isaac Lab step outputs shaped as its documentation states.

Isaac Sim cannot be installed on loopgate's CPU machines, so two things stand in for it,
and only those: :class:`ReplayEnv` replays ``tests/fixtures/isaac/reach_franka.*``
(``Isaac-Reach-Franka-v0``'s outputs laid out as Isaac Lab documents them; see
``make_reach_franka.py``) with Isaac Lab's buffer habits (``reward``, ``terminated`` and
``time_outs`` refilled in place, ``extras["log"]`` rebuilt only on reset steps, critic
terms as views of simulator state); and stand-in ``isaaclab`` / ``isaaclab_tasks``
modules record how the adapter starts the app and builds the env (real gymnasium
registry and ``gym.make``). Torch, numpy and the adapter code are real; the same code
path runs against a real simulator in ``test_mjlab_conformance.py``.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces

from gateway.config import ConfigError
from gateway.factory import experiment_spec
from gateway.registry import ISAAC_HINT
from sim_bridges.batched import TorchEnvBackend

pytestmark = pytest.mark.unit

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "isaac"
DATA = dict(np.load(FIXTURE / "reach_franka.npz"))
META = json.loads((FIXTURE / "reach_franka.json").read_text())
N, T = META["num_envs"], len(DATA["reward"])


class ReplayEnv(gym.Env):  # type: ignore[misc]
    """``ManagerBasedRLEnv``'s surface (a ``gymnasium.Env``), replaying the fixture with Isaac Lab's buffer habits."""

    def __init__(self, *, device: str = "cpu", num_envs: int = N, **overrides: Any) -> None:
        self.num_envs, self.device = num_envs, device
        self.step_dt, self.max_episode_length = META["step_dt"], META["max_episode_length"]
        self.single_observation_space = spaces.Dict(
            {
                "policy": spaces.Box(-np.inf, np.inf, shape=(32,), dtype=np.float32),
                "critic": spaces.Dict(
                    {
                        "joint_pos": spaces.Box(-np.inf, np.inf, shape=(9,), dtype=np.float32),
                        "joint_vel": spaces.Box(-np.inf, np.inf, shape=(9,), dtype=np.float32),
                    }
                ),
            }
        )
        self.single_action_space = spaces.Box(-np.inf, np.inf, shape=(META["action_dim"],), dtype=np.float32)
        self.overrides = overrides
        self.t = 0
        self.resets: list[int | None] = []
        self.actions: list[torch.Tensor] = []
        self.closed = 0
        # Isaac Lab's persistent buffers: the managers refill these every step.
        self.reward_buf = torch.zeros(N)
        self.reset_terminated = torch.zeros(N, dtype=torch.bool)
        self.reset_time_outs = torch.zeros(N, dtype=torch.bool)
        self.joint_state = torch.zeros(N, 18)  # simulator state; critic terms are views of it
        self.extras: dict[str, Any] = {}

    def _obs(self, row: int) -> dict[str, Any]:
        self.joint_state[:, :9] = torch.from_numpy(DATA["critic_joint_pos"][row])
        self.joint_state[:, 9:] = torch.from_numpy(DATA["critic_joint_vel"][row])
        obs = {
            "policy": torch.from_numpy(DATA["policy"][row].copy()),  # concatenated anew, as torch.cat does
            "critic": {"joint_pos": self.joint_state[:, :9], "joint_vel": self.joint_state[:, 9:]},
        }
        for key, value in self.overrides.items():
            obs[key] = value(obs[key]) if callable(value) else value
        return obs

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        self.resets.append(seed)
        self.t = 0
        self.extras["log"] = {k: torch.tensor(v) for k, v in META["reset_log"].items()}
        return self._obs(0), self.extras

    def step(self, action: torch.Tensor) -> Any:
        self.actions.append(action)
        t = self.t
        self.reward_buf[:] = torch.from_numpy(DATA["reward"][t])
        self.reset_terminated[:] = torch.from_numpy(DATA["terminated"][t])
        self.reset_time_outs[:] = torch.from_numpy(DATA["time_outs"][t])
        if (self.reset_terminated | self.reset_time_outs).any():  # _reset_idx rebuilds the log
            self.extras["log"] = {k: torch.tensor(v) for k, v in META["step_log"][str(t)].items()}
        self.t += 1
        return self._obs(t + 1), self.reward_buf, self.reset_terminated, self.reset_time_outs, self.extras

    def close(self) -> None:
        self.closed += 1


def backend_for(env: ReplayEnv, **kwargs: Any) -> TorchEnvBackend:
    kwargs.setdefault("groups", {"policy": "policy", "critic": "critic"})
    return TorchEnvBackend(env, name=META["task"], **kwargs)


def zeros() -> np.ndarray:
    return np.zeros((N, META["action_dim"]), np.float32)


def run_all(backend: TorchEnvBackend) -> list[Any]:
    backend.reset()
    return [backend.step(zeros()) for _ in range(T)]


# ------------------------------------------------------------------------- mapping


def test_policy_tensor_and_critic_terms_become_spec_keys_before_any_reset():
    env = ReplayEnv()
    backend = backend_for(env)
    spec = backend.spec
    assert dict(spec.observation) == {
        "policy": spec.observation["policy"],
        "critic.joint_pos": spec.observation["critic.joint_pos"],
        "critic.joint_vel": spec.observation["critic.joint_vel"],
    }
    assert spec.observation["policy"].shape == (32,) and spec.observation["policy"].dtype == "float32"
    assert spec.observation["critic.joint_pos"].shape == (9,)
    assert spec.action.shape == (7,) and spec.action.low[0] == -np.inf
    assert spec.control_hz == pytest.approx(30.0) and spec.max_episode_steps == 360
    assert backend.provides_final_obs is False and env.resets == []
    obs, _ = backend.reset()
    assert spec.check_observation(obs, N) == []
    np.testing.assert_array_equal(obs["policy"], DATA["policy"][0])


def test_groups_are_renamed_and_unmapped_groups_are_not_sent():
    backend = backend_for(ReplayEnv(), groups={"policy": "actor"})
    assert set(backend.spec.observation) == {"actor"}
    obs, _ = backend.reset()
    assert set(obs) == {"actor"}
    with pytest.raises(
        ValueError, match=r"groups \['actor'\] are not in the env; it has \['critic', 'policy'\]"
    ):
        backend_for(ReplayEnv(), groups={"actor": "policy"})


def test_flags_and_rewards_the_env_refills_in_place_stay_as_returned():
    env = ReplayEnv()
    steps = run_all(backend_for(env))
    for t, (_, reward, terminated, truncated, _) in enumerate(steps):
        np.testing.assert_array_equal(terminated, DATA["terminated"][t], err_msg=f"terminated at step {t}")
        np.testing.assert_array_equal(truncated, DATA["time_outs"][t], err_msg=f"time_outs at step {t}")
        np.testing.assert_array_equal(reward, DATA["reward"][t], err_msg=f"reward at step {t}")
        assert terminated.dtype == np.bool_ and reward.dtype == np.float32
    assert not np.shares_memory(steps[0][2], env.reset_terminated.numpy())


def test_done_env_returns_its_next_first_observation_and_no_terminal_one():
    steps = run_all(backend_for(ReplayEnv()))
    for t, (obs, _, terminated, truncated, info) in enumerate(steps):
        assert "final_obs" not in info, f"step {t}: a terminal observation that Isaac Lab never returns"
        done = terminated | truncated
        np.testing.assert_array_equal(obs["policy"], DATA["policy"][t + 1])
        for i in np.flatnonzero(done):
            assert not np.array_equal(obs["policy"][i], DATA["terminal_policy"][t][i])
    assert steps[2][2][1] and steps[4][3][0]  # the fixture has both kinds of ends


def test_time_outs_are_truncations_and_terminations_are_not():
    steps = run_all(backend_for(ReplayEnv()))
    terminated = np.stack([s[2] for s in steps])
    truncated = np.stack([s[3] for s in steps])
    np.testing.assert_array_equal(truncated, DATA["time_outs"])
    np.testing.assert_array_equal(terminated, DATA["terminated"])
    assert (terminated & truncated).any()  # both at once stay both


def test_extras_log_is_forwarded_only_on_steps_with_a_reset():
    backend = backend_for(ReplayEnv())
    _, info = backend.reset()
    assert info["log"] == META["reset_log"]
    for t in range(T):
        *_, info = backend.step(zeros())
        want = META["step_log"].get(str(t))
        if want is None:  # Isaac Lab's stale dict of the last reset is still in extras here
            assert "log" not in info, f"step {t}: a stale extras['log'] was forwarded"
        else:
            assert info["log"] == pytest.approx(want), f"step {t}"
            assert all(isinstance(v, float) for v in info["log"].values())


def test_critic_terms_that_view_simulator_state_are_copied():
    env = ReplayEnv()
    backend = backend_for(env)
    obs, _ = backend.reset()
    first = obs["critic.joint_pos"].copy()
    backend.step(zeros())  # refills env.joint_state in place
    np.testing.assert_array_equal(obs["critic.joint_pos"], first)
    assert not np.shares_memory(obs["critic.joint_pos"], env.joint_state.numpy())


def test_policy_group_is_handed_out_without_a_copy_on_the_cpu():
    env = ReplayEnv()
    backend = backend_for(env)
    captured: list[torch.Tensor] = []
    original = env._obs

    def capture(row: int) -> dict[str, Any]:
        obs = original(row)
        captured.append(obs["policy"])
        return obs

    env._obs = capture  # type: ignore[method-assign]
    obs, _ = backend.reset()
    assert np.shares_memory(obs["policy"], captured[-1].numpy())


def test_a_strided_group_tensor_arrives_as_a_c_ordered_array():
    backend = backend_for(ReplayEnv(policy=lambda t: t.t().contiguous().t()))  # column-major storage
    obs, _ = backend.reset()
    assert obs["policy"].flags.c_contiguous
    np.testing.assert_array_equal(obs["policy"], DATA["policy"][0])


def test_a_group_tensor_refilled_in_place_is_caught_and_copied_from_then_on(caplog):
    shared = torch.zeros(N, 32)

    def refill(fresh: torch.Tensor) -> torch.Tensor:
        shared.copy_(fresh)
        return shared

    backend = backend_for(ReplayEnv(policy=refill))
    backend.reset()  # handed out as a view: the refill at the next step is what gets caught
    second = backend.step(zeros())[0]
    assert "refilled the tensor it returned last step" in caplog.text
    third = backend.step(zeros())[0]
    np.testing.assert_array_equal(second["policy"], DATA["policy"][1])
    np.testing.assert_array_equal(third["policy"], DATA["policy"][2])
    assert not np.shares_memory(third["policy"], shared.numpy())


# ------------------------------------------------------------------------ checks


def test_batch_whose_leading_dimension_is_not_num_envs_is_a_clear_error():
    backend = backend_for(ReplayEnv(policy=lambda t: t[:3]))
    with pytest.raises(
        ValueError, match=r"observation group 'policy' has leading dimension \(3,\).*num_envs=4"
    ):
        backend.reset()


def test_tensor_on_the_wrong_device_is_a_clear_error():
    # The env says cuda:0 (what Isaac Lab reports on a GPU machine); the tensors it returns are on the CPU.
    backend = backend_for(ReplayEnv(device="cuda:0"))
    with pytest.raises(
        ValueError, match=r"observation group 'policy' is on cpu, expected the env's device cuda:0"
    ):
        backend.reset()


def test_tensor_of_the_wrong_dtype_is_a_clear_error():
    backend = backend_for(ReplayEnv(policy=lambda t: t.double()))
    with pytest.raises(ValueError, match=r"observation group 'policy' is float64, expected float32"):
        backend.reset()


def test_reward_of_the_wrong_dtype_is_a_clear_error_and_nothing_is_returned():
    env = ReplayEnv()
    env.reward_buf = torch.zeros(N, dtype=torch.float64)
    backend = backend_for(env)
    backend.reset()
    with pytest.raises(ValueError, match=r"reward is float64, expected float32"):
        backend.step(zeros())


def test_actions_reach_the_env_as_tensors_and_clip_actions_bounds_them():
    env = ReplayEnv()
    backend = backend_for(env, clip_actions=0.5)
    assert backend.spec.action.low == (-0.5,) * 7 and backend.spec.action.high == (0.5,) * 7
    backend.reset()
    action = np.full((N, 7), 0.3, np.float32)
    action[0, 0] = 0.9
    backend.step(action)
    sent = env.actions[-1]
    assert isinstance(sent, torch.Tensor) and sent.dtype == torch.float32 and sent.device.type == "cpu"
    assert sent[0, 0].item() == pytest.approx(0.5) and sent[1, 1].item() == pytest.approx(0.3)
    with pytest.raises(ValueError, match=r"action.*float32\[4, 7\]"):
        backend.step(np.zeros((N + 1, 7), np.float32))
    with pytest.raises(ValueError, match=r"clip_actions must be > 0"):
        backend_for(ReplayEnv(), clip_actions=0.0)


def test_seed_goes_to_the_first_reset_and_reset_is_called_only_when_asked():
    env = ReplayEnv()
    backend = backend_for(env, seed=7)
    backend.reset()
    for _ in range(T):
        backend.step(zeros())
    backend.reset(seed=3)
    backend.reset()
    assert env.resets == [7, 3, None]  # autoreset happens inside step: no reset() calls from steps


def test_close_closes_the_env_once():
    env = ReplayEnv()
    backend = backend_for(env)
    backend.close()
    backend.close()
    assert env.closed == 1
    with pytest.raises(RuntimeError, match="closed"):
        backend.reset()


# ---------------------------------------------------------------- the isaac adapter


class FakeIsaac:
    """Stand-ins for ``isaaclab.app`` and ``isaaclab_tasks`` that record the calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.apps: list[Any] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        fake = self

        class App:
            def close(self) -> None:
                fake.calls.append(("app.close", None))

        class AppLauncher:
            def __init__(self, **kwargs: Any) -> None:
                fake.calls.append(("AppLauncher", kwargs))
                self.app = App()
                fake.apps.append(self.app)

        class Cfg:
            def __init__(self, num_envs: int) -> None:
                self.seed: int | None = None
                self.episode_length_s = 12.0
                self.decimation = 2
                self.sim = types.SimpleNamespace(dt=1.0 / 60.0)
                self.num_envs = num_envs

        def parse_env_cfg(task: str, device: str = "cuda:0", num_envs: int | None = None) -> Cfg:
            assert ("AppLauncher", fake.calls[0][1]) == fake.calls[0], "parse_env_cfg before the app started"
            fake.calls.append(("parse_env_cfg", (task, device, num_envs)))
            return Cfg(num_envs or 1)

        def tasks_imported() -> types.ModuleType:
            assert fake.calls and fake.calls[0][0] == "AppLauncher", "isaaclab_tasks imported before the app"
            fake.calls.append(("import isaaclab_tasks", None))
            return types.ModuleType("isaaclab_tasks")

        isaaclab = types.ModuleType("isaaclab")
        app_module = types.ModuleType("isaaclab.app")
        app_module.AppLauncher = AppLauncher  # type: ignore[attr-defined]
        utils = types.ModuleType("isaaclab_tasks.utils")
        utils.parse_env_cfg = parse_env_cfg  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "isaaclab", isaaclab)
        monkeypatch.setitem(sys.modules, "isaaclab.app", app_module)
        monkeypatch.setitem(sys.modules, "isaaclab_tasks.utils", utils)

        real_import = __import__("importlib").import_module

        def import_module(name: str, package: str | None = None) -> Any:
            if name == "isaaclab_tasks":
                return tasks_imported()
            return real_import(name, package)

        import sim_bridges.isaac as isaac

        monkeypatch.setattr(isaac.importlib, "import_module", import_module)
        monkeypatch.setattr(isaac, "_app", None)
        monkeypatch.setattr(isaac, "_state", "none")

        def entry(cfg: Cfg, **kwargs: Any) -> ReplayEnv:
            fake.calls.append(("gym.make", cfg))
            env = ReplayEnv(num_envs=cfg.num_envs)
            env.max_episode_length = int(np.ceil(cfg.episode_length_s / (cfg.sim.dt * cfg.decimation)))
            return env

        if META["task"] in gym.registry:
            del gym.registry[META["task"]]
        gym.register(META["task"], entry_point=entry, disable_env_checker=True)  # as isaaclab_tasks does


@pytest.fixture
def fake_isaac(monkeypatch: pytest.MonkeyPatch) -> Any:
    fake = FakeIsaac()
    fake.install(monkeypatch)
    yield fake
    gym.registry.pop(META["task"], None)


def test_isaac_adapter_starts_the_app_first_then_parse_env_cfg_then_gym_make(fake_isaac):
    from sim_bridges.isaac import IsaacLabBackend, IsaacLabConfig

    config = IsaacLabConfig(
        device="cpu", enable_cameras=True, groups={"policy": "policy", "critic": "critic"}
    )
    backend = IsaacLabBackend(config, num_envs=N, seed=5)
    names = [c[0] for c in fake_isaac.calls]
    assert names == ["AppLauncher", "import isaaclab_tasks", "parse_env_cfg", "gym.make"]
    assert fake_isaac.calls[0][1] == {"headless": True, "device": "cpu", "enable_cameras": True}
    assert fake_isaac.calls[2][1] == (META["task"], "cpu", N)
    assert fake_isaac.calls[3][1].seed == 5
    assert backend.env is not backend.raw  # gym.make's wrapper; the attributes come from env.unwrapped
    obs, _ = backend.reset()
    assert set(obs) == {"policy", "critic.joint_pos", "critic.joint_vel"}
    assert backend.step(zeros())[0]["policy"].shape == (N, 32)
    backend.close()
    assert [c[0] for c in fake_isaac.calls][-1] == "app.close"


def test_isaac_max_episode_steps_sets_the_task_length_in_steps(fake_isaac):
    from sim_bridges.isaac import IsaacLabBackend, IsaacLabConfig

    backend = IsaacLabBackend(IsaacLabConfig(device="cpu", max_episode_steps=7), num_envs=2)
    assert backend.spec.max_episode_steps == 7
    backend.close()


def test_a_second_isaac_env_in_one_process_is_refused(fake_isaac):
    from sim_bridges.isaac import IsaacLabBackend, IsaacLabConfig

    config = IsaacLabConfig(device="cpu")
    first = IsaacLabBackend(config, num_envs=2)
    with pytest.raises(RuntimeError, match="one simulation context per process"):
        IsaacLabBackend(config, num_envs=2)
    assert len(fake_isaac.apps) == 1
    first.close()
    with pytest.raises(RuntimeError, match="closed its Isaac Sim app"):
        IsaacLabBackend(config, num_envs=2)


def test_isaac_and_mjlab_adapters_share_one_code_path():
    from sim_bridges.isaac import IsaacLabBackend
    from sim_bridges.mjlab import MjlabBackend

    for method in ("reset", "step", "_observations", "_check", "_to_numpy", "_log"):
        assert getattr(IsaacLabBackend, method) is getattr(TorchEnvBackend, method), method
        assert getattr(MjlabBackend, method) is getattr(TorchEnvBackend, method), method


# ------------------------------------------------------------------ missing isaac


def test_missing_isaac_config_error_says_what_it_needs():
    assert "isaaclab" not in sys.modules
    with pytest.raises(ConfigError) as err:
        experiment_spec("isaac", {"task": "Isaac-Reach-Franka-v0"})
    text = str(err.value)
    assert "missing Python package 'isaaclab'" in text
    for need in (
        "Python 3.12",
        "glibc >= 2.35",
        "RTX-class NVIDIA GPU",
        "Python 3.11",
        "env.python",
        "docs/isaac.md",
    ):
        assert need in text, need
    assert ISAAC_HINT in text


def test_isaac_options_are_validated_with_the_field_named():
    with pytest.raises(ConfigError, match=r"env.options.device must be 'cpu' or 'cuda\[:N\]', got 'tpu'"):
        experiment_spec("isaac", {"device": "tpu"})
    with pytest.raises(ConfigError, match=r"env.options: unknown key\(s\) num_env"):
        experiment_spec("isaac", {"num_env": 3})


def test_doctor_says_what_isaac_needs_and_where_the_mjlab_venv_is():
    from tests.conftest import loopgate

    out = loopgate("doctor", "--json", timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    checks = {c["name"]: c for c in json.loads(out.stdout)["checks"]}
    isaac = checks["isaac lab"]
    assert "glibc" in isaac["detail"] and "Python" in isaac["detail"]
    if not isaac["ok"]:  # not in loopgate's own venv: Isaac has a venv of its own
        assert isaac["fix"] == ISAAC_HINT
    mjlab = checks["mjlab venv"]
    assert mjlab["ok"], mjlab  # make install creates it
    assert "mjlab 1.6.0" in mjlab["detail"] and ".venv-mjlab/bin/python" in mjlab["detail"]


def test_isaac_example_config_validates_and_names_its_interpreter():
    from gateway.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "isaac_reach_franka.yaml")
    assert cfg.env.backend == "isaac" and cfg.env.python == "~/isaac-venv/bin/python"
    assert cfg.env.options["task"] == "Isaac-Reach-Franka-v0" and cfg.env.options["device"] == "cuda:0"


@pytest.mark.timeout(120)
def test_isaac_missing_from_the_worker_venv_stops_up_with_what_isaac_needs(tmp_path):
    from tests.conftest import REPO, loopgate, time_left

    python = REPO / ".venv-mjlab" / "bin" / "python"  # a real second venv, without Isaac
    assert python.exists(), f"{python} is missing: `make install` creates it"
    config = tmp_path / "isaac.yaml"
    config.write_text(
        f"env: {{backend: isaac, python: {python}, num_envs: 2, options: {{device: 'cuda:0'}}}}\n"
        "policy: {kind: random}\n"
    )
    out = loopgate("up", str(config), "--run-dir", str(tmp_path / "run"), timeout=time_left())
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"env.backend 'isaac' cannot be built by {python}" in out.stderr
    assert "missing Python package 'isaaclab'" in out.stderr and "Python 3.12" in out.stderr
    assert not (tmp_path / "run" / "endpoints.json").exists()
