"""Algorithms, publication guards and the trainer config, on real torch (one process)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from gateway.config import ConfigError, from_dict
from networks.config import NetworkConfig
from sim_bridges.reach import ReachTask
from trainer.algos import make_algorithm
from trainer.publish import Publisher

pytestmark = pytest.mark.unit
torch.set_num_threads(1)
SPEC = ReachTask().spec(max_episode_steps=50)
NET = NetworkConfig(hidden_sizes=(64, 64))


def batch(
    n: int = 64, seed: int = 0, reward: float = 1.0, terminated: bool = True
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"obs/{k}": torch.randn(n, *a.shape, generator=g) for k, a in SPEC.observation.items()}
    out.update({f"next_obs/{k}": torch.randn(n, *a.shape, generator=g) for k, a in SPEC.observation.items()})
    out["action"] = torch.rand(n, 3, generator=g) * 2 - 1
    out["reward"] = torch.full((n,), reward)
    out["terminated"] = torch.full((n,), float(terminated))
    return out


def params(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def test_sac_critics_learn_a_terminal_reward():
    torch.manual_seed(0)
    algo = make_algorithm("sac", SPEC, NET, {}, device=torch.device("cpu"))
    algo.build_optimizers()
    b = batch(reward=1.0, terminated=True)  # Q(s, a) = 1 everywhere
    first = algo.update(b)["loss/critic"]
    for _ in range(150):
        stats = algo.update(b)
    assert stats["skipped"] == 0.0 and stats["loss/critic"] < 0.1 * first
    assert abs(stats["q"] - 1.0) < 0.2


def test_non_finite_loss_skips_the_update_and_leaves_weights_alone():
    algo = make_algorithm("sac", SPEC, NET, {}, device=torch.device("cpu"))
    algo.build_optimizers()
    before = params(algo.nets)
    bad = batch()
    bad["reward"][3] = float("nan")
    assert algo.update(bad) == {"skipped": 1.0}
    assert algo.skipped_updates == 1
    after = params(algo.nets)
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    assert algo.update(batch())["skipped"] == 0.0  # and training goes on


def test_behaviour_cloning_imitates_a_demonstrator():
    torch.manual_seed(0)
    algo = make_algorithm("bc", SPEC, NET, {"lr": 3e-3}, device=torch.device("cpu"))
    algo.build_optimizers()

    def demo(b):  # a fixed rule the actor must recover
        b["action"] = torch.tanh(b["obs/target_rel"][:, [0, 1, 0]] * 3)
        return b

    def error():
        b = demo(batch(256, seed=99))
        obs = {k[4:]: v for k, v in b.items() if k.startswith("obs/")}
        with torch.no_grad():
            return float((algo.actor(obs, torch.zeros(256, 3)) - b["action"]).abs().mean())

    before = error()
    for i in range(300):
        algo.update(demo(batch(128, seed=i)))
    assert error() < 0.35 * before


@pytest.fixture
def silent() -> Iterator[tuple[Any, str]]:
    """A real ROUTER socket playing an inference server that takes the weights and never
    answers, and its address."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield sock, f"tcp://127.0.0.1:{port}"
    finally:
        sock.close()


def test_publisher_never_sends_non_finite_weights():
    pub = Publisher(spec=SPEC, net_config=NET, targets=[], onnx=False, control=None)
    try:
        weights = {"w": np.ones(3, np.float32), "b": np.array([np.inf], np.float32)}
        pub.submit(5, weights)
        deadline = time.monotonic() + 5
        while pub.refused == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pub.refused == 1 and pub.published_version == 0
        pub.submit(6, {"w": np.ones(3, np.float32)})
        pub.flush()
        deadline = time.monotonic() + 5
        while pub.published_version != 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pub.published_version == 6
    finally:
        pub.close()


def test_a_stop_cuts_short_a_publication_that_waits_for_a_server_gone_silent(silent):
    """An inference server that takes the weights and never answers (it died with the
    rest of the run): once the trainer is told to stop, the wait already in progress ends
    within the stopping limit, not the 60 s publication timeout, so the rank can exit
    before torchrun's shutdown limit. A real ROUTER socket plays the silent server."""
    pub = Publisher(
        spec=SPEC, net_config=NET, targets=[{"weights": silent[1]}], onnx=False, control=None, timeout_s=60.0
    )
    try:
        pub.submit(1, {"w": np.ones(3, np.float32)})
        assert silent[0].poll(10_000), "the publication never reached the server"
        assert pub.failures == 0  # still waiting for the answer that will not come
        pub.shorten_waits(1.0)
        deadline = time.monotonic() + 30
        while pub.failures == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pub.failures == 1 and pub.published_version == 0
        assert pub.request_timeout_s == 1.0
    finally:
        pub.close()


def test_every_version_made_is_recorded_before_the_trainer_goes_on(silent, tmp_path):
    """A trainer killed while its publication thread still waits on a server that went
    silent (the whole run is being killed) has made versions that thread never took: one
    queued, one superseded in the queue. Its metrics already said so, and a restarted
    trainer must continue after the newest, never make another version with a number it
    used. A real ROUTER socket plays the silent server."""
    from trainer.versions import PUBLISHED, last_published

    record = tmp_path / PUBLISHED
    pub = Publisher(
        spec=SPEC,
        net_config=NET,
        targets=[{"weights": silent[1]}],
        onnx=False,
        control=None,
        timeout_s=60.0,
        record=record,
    )
    try:
        pub.submit(1, {"w": np.ones(3, np.float32)})
        assert silent[0].poll(10_000), "the publication never reached the server"
        pub.submit(2, {"w": np.ones(3, np.float32)})
        pub.submit(3, {"w": np.ones(3, np.float32)})  # 2 is superseded before it was sent
        assert last_published(record) == 3  # what a trainer killed now continues after
        assert pub.published_version == 0  # none of them has reached its server
    finally:
        pub.shorten_waits(0.5)
        pub.close()


@pytest.mark.parametrize(
    ("trainer", "message"),
    [
        ({"nproc": 0}, "trainer.nproc"),
        ({"batch_size": 255, "nproc": 2}, "must divide evenly"),
        ({"tables": {"online": 0}}, "trainer.tables"),
        ({"mode": "eventually"}, "trainer.mode"),
        ({"max_policy_lag": 0}, "trainer.max_policy_lag"),
    ],
)
def test_trainer_config_errors_name_the_field(trainer, message):
    with pytest.raises(ConfigError, match=message):
        from_dict({"trainer": trainer})


def test_unknown_algorithm_and_bad_options_are_refused():
    with pytest.raises(ValueError, match="unknown algorithm 'ppo2'"):
        make_algorithm("ppo2", SPEC, NET, {}, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"trainer\.options\.gamma"):
        make_algorithm("sac", SPEC, NET, {"gamma": 1.5}, device=torch.device("cpu"))


def test_published_weights_are_a_snapshot_not_the_live_parameters():
    from networks.modules import make_actor
    from trainer.publish import full_state_dict

    actor = make_actor(SPEC, NET, seed=0)
    snapshot = full_state_dict(actor)
    before = {k: v.copy() for k, v in snapshot.items()}
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(1.0)  # what the next optimizer step does in place
    for k, v in snapshot.items():
        np.testing.assert_array_equal(v, before[k])


def test_a_snapshot_reuses_spare_buffers_and_takes_the_new_values():
    """The publisher hands a finished publication's arrays back for the next snapshot: the
    same memory, the current parameters, still not aliasing them."""
    from networks.modules import make_actor
    from trainer.publish import full_state_dict

    actor = make_actor(SPEC, NET, seed=0)
    first = full_state_dict(actor)
    with torch.no_grad():
        for p in actor.parameters():
            p.mul_(2.0)
    second = full_state_dict(actor, first)
    live = {k: v.detach().numpy() for k, v in actor.state_dict().items()}
    for k, v in second.items():
        assert v is first[k]  # no new allocation
        np.testing.assert_array_equal(v, live[k])
        assert not np.shares_memory(v, live[k])
    wrong_shape = {k: np.zeros(1, np.float32) for k in first}
    third = full_state_dict(actor, wrong_shape)  # does not fit: fresh arrays instead
    assert all(third[k] is not wrong_shape[k] for k in third)


def test_the_final_version_is_the_newest_of_the_publications_and_the_latest_checkpoint(tmp_path):
    """``summary.json``'s policy version: a trainer's checkpoint counters (the ``latest``
    marker ``trainer.checkpoint.save`` writes) and the publications' record, whichever is
    newer; a torn or missing file counts as nothing."""
    from trainer.versions import PUBLISHED, final_version, record_published

    assert final_version(tmp_path) == 0
    (tmp_path / "latest").write_text('{"path": "step-000000040", "updates": 40, "version": 4, "samples": 9}')
    assert final_version(tmp_path) == 4  # no inference servers: nothing published
    record_published(tmp_path / PUBLISHED, 5)
    assert final_version(tmp_path) == 5  # published, not yet checkpointed
    record_published(tmp_path / PUBLISHED, 3)
    assert final_version(tmp_path) == 4
    (tmp_path / "latest").write_text('{"path": "step-0')  # torn
    assert final_version(tmp_path) == 3
