"""The ``intervention`` flag: takeover steps marked in the spool, the chunks, the replay
service's tables, the exports and the gateway's metrics.

The replay, recorder and export parts run on real chunks in memory and real files; the
end-to-end test drives a real gateway process and a real MuJoCo worker with a takeover
client (what the console's teleoperation does).
"""

from __future__ import annotations

import json
import math
import threading
import time

import numpy as np
import pytest

from gateway.client import GatewayVectorEnv
from gateway.console.teleop import TeleopLoop, TeleopSettings
from gateway.policies import InProcessSource, Policy
from gateway.protocol import Message, MsgType, ProtocolError
from gateway.recorder import InterventionRate
from gateway.store import EpisodeStore
from gateway.trajectory import STEP_FIELDS, StepRows, Transitions, assemble_episodes, validate_chunk
from tests.conftest import wait_for
from trainer.replay.config import ReplayConfig, TableConfig
from trainer.replay.core import ReplayBuffer


def rows(episode: str, steps: int, flags: list[bool], first: int = 0) -> StepRows:
    out = StepRows(episode, "w0", 0, "reach")
    for i in range(steps):
        out.add(
            {"x": np.full(2, first + i, np.float32)},
            np.full(3, i, np.float32),
            reward=np.float32(i),
            terminated=False,
            truncated=False,
            success=False,
            policy_version=1,
            t_capture=1000.0 + i,
            t_action=1000.5 + i,
            step=first + i,
            intervention=flags[i],
        )
    return out


def transitions(flags: list[bool]) -> Transitions:
    n = len(flags)
    columns = {key: np.zeros(n, dtype) for key, dtype in STEP_FIELDS.items()}
    columns["step"] = np.arange(n, dtype=np.int64)
    columns["intervention"] = np.asarray(flags)
    return Transitions(
        [f"w0-{i}-0" for i in range(n)],
        np.arange(n),
        {"x": np.zeros((n, 2), np.float32)},
        np.zeros((n, 3), np.float32),
        columns,
    )


@pytest.mark.unit
def test_the_flag_survives_the_spool_and_an_older_spool_reads_as_no_interventions():
    steps = transitions([True, False, True])
    again = Transitions.from_spool(steps.episodes, steps.spool_arrays())
    assert again.columns["intervention"].tolist() == [True, False, True]
    assert again.columns["intervention"].dtype == np.bool_
    old = steps.spool_arrays()
    old["scalars"] = old["scalars"][:, : len(STEP_FIELDS) - 1]  # written before the flag existed
    older = Transitions.from_spool(steps.episodes, old)
    assert older.columns["intervention"].tolist() == [False, False, False]
    np.testing.assert_array_equal(older.columns["step"], [0, 1, 2])


@pytest.mark.unit
def test_a_chunk_without_the_flag_validates_as_policy_steps_and_a_bad_flag_is_refused():
    chunk = rows("w0-0-0", 4, [True, True, False, False]).to_chunk()
    assert chunk.arrays["intervention"].tolist() == [True, True, False, False]
    validate_chunk(chunk)
    old = Message(MsgType.TRAJECTORY_CHUNK, meta=dict(chunk.meta), arrays=dict(chunk.arrays))
    del old.arrays["intervention"]
    validate_chunk(old)
    assert old.arrays["intervention"].tolist() == [False] * 4
    assert assemble_episodes([old])[0].arrays["intervention"].tolist() == [False] * 4
    bad = Message(MsgType.TRAJECTORY_CHUNK, meta=dict(chunk.meta), arrays=dict(chunk.arrays))
    bad.arrays["intervention"] = np.zeros(4, np.float32)
    with pytest.raises(ProtocolError, match="'intervention' is float32"):
        validate_chunk(bad)


def buffer() -> ReplayBuffer:
    return ReplayBuffer(
        ReplayConfig(
            tables=[
                TableConfig(name="online", source="online"),
                TableConfig(name="interventions", source="interventions"),
                TableConfig(name="demos", source="demos"),
            ]
        )
    )


@pytest.mark.unit
def test_intervention_steps_go_to_the_interventions_table_as_well_as_online():
    buf = buffer()
    flags = [False, True, True, False, True, False]
    chunk = rows("w0-0-0", 6, flags).to_chunk(end="truncated", final_obs={"x": np.zeros(2, np.float32)})
    buf.insert(chunk, "online")
    assert buf.tables["online"].size == 6
    assert buf.tables["interventions"].size == 3 and buf.tables["demos"].size == 0
    batch = buf.sample({"interventions": 64})
    # Every sampled item is an intervention step: actions 1, 2 and 4 of the chunk.
    assert set(batch["action"][:, 0].tolist()) == {1.0, 2.0, 4.0}
    mixed = buf.sample({"online": 32, "interventions": 32})
    assert mixed["table"].tolist() == [0] * 32 + [1] * 32


@pytest.mark.unit
def test_an_older_chunk_without_the_flag_feeds_online_only():
    buf = buffer()
    chunk = rows("w0-0-0", 5, [True] * 5).to_chunk(end="truncated", final_obs={"x": np.zeros(2, np.float32)})
    del chunk.arrays["intervention"]
    buf.insert(chunk, "online")
    assert buf.tables["online"].size == 5 and buf.tables["interventions"].size == 0


@pytest.mark.unit
def test_the_interventions_table_follows_episodes_across_chunks():
    buf = buffer()
    buf.insert(rows("w0-0-0", 4, [False, False, True, True]).to_chunk(), "online")
    # The last step of an open chunk waits for its next observation, in both tables.
    assert (buf.tables["online"].size, buf.tables["interventions"].size) == (3, 1)
    tail = rows("w0-0-0", 2, [True, False], first=4)
    buf.insert(tail.to_chunk(end="truncated", final_obs={"x": np.zeros(2, np.float32)}), "online")
    assert (buf.tables["online"].size, buf.tables["interventions"].size) == (6, 3)


@pytest.mark.unit
def test_intervention_rate_is_over_the_last_window_of_steps():
    rate = InterventionRate(window=100)
    assert rate.rate() == 0.0
    rate.add(50, 50)
    assert rate.rate() == 1.0
    rate.add(50, 0)
    assert rate.rate() == pytest.approx(0.5)
    for _ in range(10):
        rate.add(10, 0)
    assert rate.rate() == pytest.approx(0.0)


@pytest.mark.unit
def test_lerobot_and_mcap_exports_carry_the_flag(tmp_path):
    pytest.importorskip("pyarrow")
    pytest.importorskip("mcap_ros2")
    import pyarrow.parquet as pq

    from tests.test_export import read_mcap
    from trainer.replay.export_lerobot import write_lerobot
    from trainer.replay.export_mcap import write_mcap

    flags = [False, True, True, False, False]
    chunk = rows("w0-0-0", 5, flags).to_chunk(end="truncated", final_obs={"x": np.zeros(2, np.float32)})
    plain = rows("w0-0-1", 3, [False] * 3).to_chunk(end="truncated", final_obs={"x": np.zeros(2, np.float32)})
    plain.meta["env"] = 1
    episodes = assemble_episodes([chunk, plain])
    result = write_lerobot(episodes, tmp_path / "lerobot", {"control_hz": 20})
    info = json.loads((tmp_path / "lerobot" / "meta" / "info.json").read_text())
    assert info["features"]["intervention"] == {"dtype": "bool", "shape": [1], "names": None}
    frames = pq.read_table(tmp_path / "lerobot" / "data" / "chunk-000" / "file-000.parquet").to_pydict()
    assert frames["intervention"] == [*flags, False, False, False]
    eps = pq.read_table(tmp_path / "lerobot" / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    assert eps.to_pydict()["loopgate/interventions"] == [2, 0]
    assert result["frames"] == 8

    out = write_mcap(episodes, tmp_path / "out.mcap")
    messages, _ = read_mcap(out["path"])
    flagged = [m for m in messages if m[0].endswith("/intervention")]
    assert len(flagged) == 2 and all(m[1] == "std_msgs/msg/Bool" and m[4].data for m in flagged)
    # Stamped with the flagged steps' capture times (steps 1 and 2: t_capture 1001, 1002).
    assert [m[2] for m in flagged] == [1001 * 10**9, 1002 * 10**9]
    infos = [json.loads(m[4].data) for m in messages if m[0].endswith("/episode")]
    assert {i["episode_id"]: i["interventions"] for i in infos} == {"w0-0-0": 2, "w0-0-1": 0}


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_takeover_steps_are_flagged_in_the_trajectory_and_counted(gateway_run):
    """A random policy drives one MuJoCo worker; a takeover client (as the console's
    teleoperation is) drives it for a while; the store holds its steps flagged, the
    policy's not, and the gateway's status counts them."""
    run = gateway_run({"env": {"backend": "mujoco_reach", "num_envs": 2}, "policy": {"kind": "random"}})
    run.worker(0)
    wait_for(lambda: run.status()["env_steps"] > 20, what="the policy's first steps")
    venv = GatewayVectorEnv(run.endpoints["clients"], takeover=True, timeout_s=10)
    try:
        venv.reset(seed=1)
        for _ in range(30):
            venv.step(np.full((2, 3), 0.01, np.float32))
    finally:
        venv.close()
    status = run.status()
    assert status["intervention_steps"] >= 60 and 0 < status["intervention_rate"] <= 1
    before = status["env_steps"]
    wait_for(lambda: run.status()["env_steps"] > before + 40, what="the policy to drive again")
    run.drain()
    episodes = EpisodeStore(run.run_dir / "episodes", readonly=True).episodes()
    flagged = np.concatenate([ep.arrays["intervention"] for ep in episodes])
    actions = np.concatenate([ep.arrays["action"] for ep in episodes])
    versions = np.concatenate([ep.arrays["policy_version"] for ep in episodes])
    # The takeover's 30 steps x 2 envs (the reset's first observation completes none).
    assert int(flagged.sum()) == 60 == status["intervention_steps"]
    np.testing.assert_allclose(actions[flagged], 0.01)
    assert not np.allclose(actions[~flagged], 0.01, atol=1e-6)
    assert (~flagged).sum() > 60 and set(versions[flagged].tolist()) == {0}


@pytest.mark.unit
def test_the_hil_config_mixes_online_and_intervention_steps_half_and_half():
    from gateway.config import load_config
    from gateway.factory import experiment_spec
    from tests.conftest import REPO
    from trainer.services import preflight

    cfg = load_config(REPO / "configs" / "reach_hil.yaml")
    assert dict(cfg.trainer.tables) == {"online": 0.5, "interventions": 0.5}
    assert cfg.replay.table("interventions").source == "interventions" and cfg.console.enabled
    preflight(cfg, experiment_spec(cfg.env.backend, dict(cfg.env.options)))


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_a_step_can_name_the_envs_a_person_drove_and_their_versions_and_bad_ones_are_refused(gateway_run):
    """The console drives one env of a worker and the policy the others: only that env's
    steps are interventions, the others carry the policy's versions."""
    from gateway.protocol import RemoteError

    run = gateway_run({"env": {"backend": "mujoco_reach", "num_envs": 3}, "policy": {"kind": "random"}})
    run.worker(0)
    wait_for(lambda: run.status()["env_steps"] > 10, what="the policy's first steps")
    venv = GatewayVectorEnv(run.endpoints["clients"], takeover=True, timeout_s=10)
    try:
        venv.reset(seed=2)
        venv.intervention = np.array([False, True, False])
        venv.policy_version = np.array([5, 0, 7])  # a policy chose envs 0 and 2's actions
        for _ in range(10):
            venv.step(np.zeros((3, 3), np.float32))
        venv.intervention = np.array([True, False])  # wrong length: refused, nothing sent
        with pytest.raises(RemoteError, match="list of 3 booleans"):
            venv.step(np.zeros((3, 3), np.float32))
        venv.intervention, venv.policy_version = None, np.array([1, 2])
        with pytest.raises(RemoteError, match=r"policy_version must be int64\[3\]"):
            venv.step(np.zeros((3, 3), np.float32))
        venv.policy_version = None
        venv.step(np.zeros((3, 3), np.float32))  # the env survived the bad request
    finally:
        venv.close()
    run.drain()
    episodes = EpisodeStore(run.run_dir / "episodes", readonly=True).episodes()
    by_env: dict[int, int] = {}
    for ep in episodes:
        by_env[int(ep.meta["env"])] = by_env.get(int(ep.meta["env"]), 0) + int(
            ep.arrays["intervention"].sum()
        )
    assert by_env == {0: 1, 1: 11, 2: 1}  # env 1 for 10 + 1 steps; every env for the last one
    versions: dict[int, set[int]] = {}
    for ep in episodes:
        versions.setdefault(int(ep.meta["env"]), set()).update(ep.arrays["policy_version"].tolist())
    assert versions == {0: {5, 0}, 1: {0}, 2: {7, 0}}


class _Steady(Policy):
    """Every env the same action: a policy whose hand-back is easy to see in the store."""

    def __init__(self, value: float) -> None:
        self.value = value

    def act(self, obs: dict[str, np.ndarray]) -> np.ndarray:
        n = len(next(iter(obs.values())))
        return np.full((n, 3), self.value, np.float32)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_release_hands_the_env_back_to_the_policy_over_a_ramp(gateway_run):
    """The console's takeover loop on a real gateway and MuJoCo worker: the operator's env
    holds (zero deltas), the others follow the policy (0.04); on Release the operator's
    env's action rises from the held 0 to the policy's 0.04 in ``ramp_steps`` even steps,
    still flagged as interventions, then the gateway's policy drives it; a hold during a
    ramp (the e-stop's path) lets go at once."""
    run = gateway_run({"env": {"backend": "mujoco_reach", "num_envs": 2}, "policy": {"kind": "random"}})
    run.worker(0)
    wait_for(lambda: run.status()["env_steps"] > 10, what="the policy's first steps")
    uid = run.status()["workers"][0]["uid"]
    settings = TeleopSettings(release_ramp_s=0.25)
    loop = TeleopLoop(
        run.endpoints["clients"], worker=uid, settings=settings, others=InProcessSource(_Steady(0.04))
    )
    n = loop.ramp_steps
    assert n == math.ceil(0.25 * loop.env.spec_.control_hz - 1e-9) >= 2
    loop.start()
    wait_for(lambda: loop.snapshot().steps >= 5, what="five steps under the takeover")
    loop.release(ramp=True)
    state = loop.snapshot()
    assert not state.active and state.ended == "released to the policy"
    before = run.status()["env_steps"]
    wait_for(lambda: run.status()["env_steps"] > before + 20, what="the gateway's policy to drive again")
    # A hold during a ramp (the e-stop's path) ends it at once, the env holding.
    split = time.time()
    slow = TeleopLoop(
        run.endpoints["clients"],
        worker=uid,
        settings=TeleopSettings(release_ramp_s=30.0),
        others=InProcessSource(_Steady(0.04)),
    )
    slow.start()
    wait_for(lambda: slow.snapshot().steps >= 3, what="three steps under the second takeover")
    releasing = threading.Thread(target=slow.release, kwargs={"ramp": True})
    releasing.start()
    wait_for(lambda: "handing back" in (slow.snapshot().holding or ""), what="the ramp to start")
    slow.hold("e-stop")
    releasing.join(timeout=settings.step_timeout_s + 5.0)
    assert not releasing.is_alive() and slow.snapshot().ended == "released"
    assert not slow.snapshot().active
    run.drain()
    episodes = EpisodeStore(run.run_dir / "episodes", readonly=True).episodes()
    mine = sorted(
        (float(t), bool(flag), float(a[0]))
        for ep in episodes
        if ep.episode_id.startswith(f"{uid}-0-")
        for t, flag, a in zip(ep.arrays["t_capture"], ep.arrays["intervention"], ep.arrays["action"])
        if t < split
    )
    flagged = [a for _, flag, a in mine if flag]
    np.testing.assert_allclose(flagged[-n:], [0.04 * (k + 1) / n for k in range(n)], atol=1e-6)
    np.testing.assert_allclose(flagged[:-n], 0.0)
    last = max(i for i, (_, flag, _) in enumerate(mine) if flag)
    assert len(mine) > last + 1 and not any(flag for _, flag, _ in mine[last + 1 :])
