"""``gateway.client``: a running gateway as a Gymnasium env and vector env."""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from gateway.client import GatewayEnv, GatewayVectorEnv
from gateway.protocol import RemoteError
from gateway.store import EpisodeStore
from tests.conftest import wait_for

pytestmark = pytest.mark.integration


def external(num_envs: int) -> dict:
    return {"env": {"backend": "mujoco_reach", "num_envs": num_envs}, "policy": {"kind": "external"}}


def test_gateway_env_passes_gymnasiums_env_checker(gateway_run):
    run = gateway_run(external(1))
    run.worker(0)
    wait_for(lambda: run.status()["workers"], what="worker registered")
    env = GatewayEnv(run.endpoints["clients"])
    try:
        check_env(env, skip_render_check=True)
        obs, _ = env.reset(seed=3)
        assert env.observation_space.contains(obs)
        for _ in range(60):  # past the 50-step limit: truncation, then a fresh episode
            obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
            assert isinstance(reward, float) and "success" in info
            if terminated or truncated:
                assert env.observation_space.contains(obs)
                obs, _ = env.reset()
    finally:
        env.close()
    final = run.drain()
    assert (
        EpisodeStore(run.run_dir / "episodes", readonly=True).count().stored_steps
        == final["acked_steps"]
        > 60
    )


def test_vector_env_autoresets_on_the_same_step(gateway_run):
    run = gateway_run(external(3))
    run.worker(0)
    wait_for(lambda: run.status()["workers"], what="worker registered")
    venv = GatewayVectorEnv(run.endpoints["clients"], num_envs=3)
    try:
        obs, _ = venv.reset(seed=0)
        assert obs["joint_pos"].shape == (3, 3)
        again, _ = venv.reset(seed=0)
        np.testing.assert_array_equal(obs["joint_pos"], again["joint_pos"])
        saw_final = False
        for _ in range(55):
            obs, reward, terminated, truncated, info = venv.step(venv.action_space.sample())
            assert reward.shape == (3,) and terminated.dtype == bool
            if np.any(truncated):
                saw_final = True
                assert info["_final_obs"].tolist() == truncated.tolist()
                assert set(info["final_obs"][0]) == set(obs)
        assert saw_final
    finally:
        venv.close()


def test_client_cannot_take_a_policy_driven_worker_without_takeover(gateway_run):
    run = gateway_run()
    run.worker(0)
    wait_for(lambda: run.status()["workers"], what="worker registered")
    with pytest.raises(RemoteError) as info:
        GatewayVectorEnv(run.endpoints["clients"], timeout_s=5)
    assert info.value.code == "unavailable" and "takeover" in info.value.message
    # With takeover the client drives it; the policy gets it back on close.
    venv = GatewayVectorEnv(run.endpoints["clients"], takeover=True, timeout_s=5)
    _obs, _ = venv.reset(seed=1)
    venv.step(venv.action_space.sample())
    venv.close()
    before = run.status()["env_steps"]
    wait_for(lambda: run.status()["env_steps"] > before + 50, what="the policy to resume")


def test_bad_actions_from_a_client_are_refused_and_the_env_survives(gateway_run):
    run = gateway_run(external(1))
    run.worker(0)
    wait_for(lambda: run.status()["workers"], what="worker registered")
    env = GatewayEnv(run.endpoints["clients"])
    try:
        env.reset(seed=0)
        from gateway.protocol import Message, MsgType

        with pytest.raises(RemoteError) as info:
            env._conn.call(Message(MsgType.STEP, arrays={"action": np.zeros((1, 5), np.float32)}))
        assert info.value.code == "bad_request" and "expected float32[1, 3]" in info.value.message
        with pytest.raises(RemoteError, match="NaN"):
            env.step(np.array([np.nan, 0, 0], np.float32))
        obs, *_ = env.step(np.zeros(3, np.float32))
        assert env.observation_space.contains(obs)
    finally:
        env.close()


def test_a_discrete_action_out_of_range_is_refused_and_the_worker_goes_on(gateway_run):
    """A script's action 2 for CartPole's ``Discrete(2)`` once reached the worker, whose
    env refused it: the worker exited, the script heard "worker ... is gone" and its
    episode ended interrupted. The gateway now refuses it, naming the range, and the
    same worker takes the next action; a batch of the wrong shape is refused by the
    client, saying the shape it needs."""
    run = gateway_run(
        {"env": {"backend": "gymnasium", "options": {"id": "CartPole-v1"}}, "policy": {"kind": "external"}}
    )
    worker = run.worker(0)
    wait_for(lambda: run.status()["workers"], what="worker registered")
    env = GatewayEnv(run.endpoints["clients"])
    try:
        env.reset(seed=0)
        env.step(1)
        for action in (2, -1):
            with pytest.raises(RemoteError) as info:
                env.step(action)
            assert info.value.code == "bad_request", info.value
            assert f"action has values outside [0, 1]: [{action}]" in info.value.message
        with pytest.raises(
            ValueError, match=r"action has shape \[2\], expected \[1\] \(1 env\(s\), each int64\[\]\)"
        ):
            env.step([0, 1])
        obs, reward, *_ = env.step(0)
        assert env.observation_space.contains(obs) and reward == 1.0
    finally:
        env.close()
    assert worker.poll() is None, "the worker is still the one that started"
    final = run.drain()
    assert final["acked_steps"] == 2, final


def test_a_script_may_name_the_run_folder_instead_of_the_address(gateway_run, tmp_path):
    """``GatewayEnv("runs/x")``: a folder (or ``endpoints.json``) once reached ZeroMQ as an
    address and failed with ``ZMQError: Invalid argument``."""
    run = gateway_run(external(1))
    run.worker(0)
    wait_for(lambda: run.status()["workers"], what="worker registered")
    for where in (run.run_dir, run.run_dir / "endpoints.json", str(run.run_dir)):
        env = GatewayEnv(where)
        try:
            env.reset(seed=0)
            env.step(np.zeros(3, np.float32))
        finally:
            env.close()
    from gateway.protocol import Timeout

    with pytest.raises(
        Timeout, match=r"names no gateway within 0.3 s: is `loopgate up` running on .*nowhere\?"
    ):
        GatewayEnv(tmp_path / "nowhere", timeout_s=0.3)


@pytest.mark.unit
def test_the_run_folders_endpoints_are_waited_for_until_loopgate_up_writes_them(tmp_path):
    import json
    import threading

    from gateway.client import clients_address

    run = tmp_path / "run"

    def start() -> None:
        run.mkdir()
        (run / "endpoints.json").write_text(json.dumps({"gateway": {"clients": "tcp://127.0.0.1:5"}}))

    threading.Timer(0.3, start).start()
    assert clients_address(run, timeout_s=30.0) == "tcp://127.0.0.1:5"
    assert clients_address("ipc:///tmp/x.sock", timeout_s=0.0) == "ipc:///tmp/x.sock"


def test_a_script_started_before_any_worker_waits_for_one(gateway_run, caplog):
    """A script started right after ``loopgate up`` attaches before any worker has
    registered: its HELLO waits (the gateway says why about once a second) and is answered
    once a worker registers, instead of failing with "no free worker"."""
    import logging
    import threading

    run = gateway_run(external(1))
    attached: list[GatewayEnv] = []
    failed: list[BaseException] = []

    def attach() -> None:
        try:
            attached.append(GatewayEnv(run.endpoints["clients"], timeout_s=5))
        except BaseException as exc:  # reported by the test below
            failed.append(exc)

    caplog.set_level(logging.INFO, logger="gateway.client")
    script = threading.Thread(target=attach, daemon=True)
    script.start()
    wait_for(lambda: "(no_worker)" in caplog.text or failed, what="the HELLO to be held for a worker")
    assert not failed, failed
    run.worker(0)
    script.join(timeout=60)
    assert not script.is_alive() and not failed, failed
    env = attached[0]
    try:
        env.reset(seed=0)
        for _ in range(10):
            env.step(env.action_space.sample())
    finally:
        env.close()
    assert run.drain()["acked_steps"] >= 10


def test_a_hello_that_waits_for_a_worker_hears_when_the_run_ends(gateway_run):
    """No worker ever registers and the run drains: the waiting script hears that the run
    ended (RunEnded), instead of waiting on."""
    import threading

    from gateway.client import RunEnded

    run = gateway_run(external(1))
    outcome: list[BaseException | None] = []

    def attach() -> None:
        try:
            GatewayEnv(run.endpoints["clients"], timeout_s=5).close()
            outcome.append(None)
        except BaseException as exc:  # checked below
            outcome.append(exc)

    script = threading.Thread(target=attach, daemon=True)
    script.start()
    wait_for(lambda: not script.is_alive() or run.status().get("clients_waiting"), what="the HELLO to wait")
    run.drain()
    script.join(timeout=30)
    assert len(outcome) == 1 and isinstance(outcome[0], RunEnded), outcome
