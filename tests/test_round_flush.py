"""The end of an on-policy round: the gateway's ``flush`` cuts every open episode's held
steps into chunks, so the round's rollout holds every step collected under its version,
and the last step of each env bootstraps on the observation after it.

Real recorder, spool and episode store on disk; a real gateway in this process with a
real env worker (the ``counter`` backend) on ``inproc://`` ZeroMQ sockets; the real
replay buffer's rollout table and the real GAE.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch
import zmq

from gateway.factory import make_backend
from gateway.protocol import Message, MsgType, recv, send
from gateway.store import EpisodeStore
from tests.conftest import wait_for
from tests.test_batched_recorder import Envs, make, run_steps
from tests.test_hub_inprocess import InProcessGateway
from tests.test_recorder import SilentSink, settle
from tests.test_trainer_ppo import SPEC, _InProcess, chunk, rollout_buffer
from trainer.algos.gae import gae, successors
from trainer.rollout import drain

pytestmark = pytest.mark.unit

KEY = next(iter(SPEC.observation))


def next_obs(envs: Envs) -> dict[str, np.ndarray]:
    """The observation each env waits in after its latest step (as the worker sent it)."""
    batch, _ = envs.batch(lazy=True)
    return {k: v.copy() for k, v in batch.obs.items()}


def test_a_flush_hands_every_held_step_to_the_sink_with_the_observation_after_it(tmp_path):
    rec = make(tmp_path)
    envs = Envs(seed=1)
    run_steps(rec, envs, 7, lazy=True)
    held = rec.undelivered_steps() - sum(n for _, _, n in rec._inflight.values())
    waiting = next_obs(envs)
    assert held > 0
    assert rec.flush({"w1": waiting}) == held
    settle(rec)
    count = EpisodeStore(tmp_path / "episodes", readonly=True).count()
    assert count.stored_steps == rec.counters.acked_steps and count.duplicate_steps == 0
    flushed = [
        c for c in EpisodeStore(tmp_path / "episodes", readonly=True).chunks() if "boot_obs/q" in c.arrays
    ]
    assert sorted(c.meta["env"] for c in flushed) == sorted(set(c.meta["env"] for c in flushed))
    assert len(flushed) == rec.open_episodes()  # every open episode held steps after 7 steps
    for c in flushed:
        assert not c.meta["final"]
        assert c.arrays["boot_obs/q"].tolist() == [waiting["q"][c.meta["env"]].tolist()]
    # Collection goes on: the next chunks start where the flush cut, nothing twice.
    run_steps(rec, envs, 9, lazy=True)
    rec.drain()
    settle(rec)
    count = EpisodeStore(tmp_path / "episodes", readonly=True).count()
    assert count.stored_steps == rec.counters.acked_steps == 6 * 16 and count.duplicate_steps == 0


def test_a_restart_after_an_unacknowledged_flush_cuts_the_same_chunks_again(tmp_path):
    rec = make(tmp_path, SilentSink)  # stores, never acknowledges: all of it is resent
    envs = Envs(seed=2)
    run_steps(rec, envs, 6, lazy=True)
    rec.flush({"w1": next_obs(envs)})
    run_steps(rec, envs, 3, lazy=True)  # steps after the cut, in the same chunk block
    settle(rec, timeout_s=0.2)
    before = rec.counters.acked_steps
    rec.sink.close()
    again = make(tmp_path)
    assert again.recover()["acked_steps"] == before
    run_steps(again, envs, 5, lazy=True)
    again.drain()
    settle(again)
    count = EpisodeStore(tmp_path / "episodes", readonly=True).count()
    # Re-cut on other boundaries, a resent chunk would reuse an id for other steps (lost)
    # or store steps under two ids (duplicated).
    assert count.duplicate_steps == 0 and count.stored_steps == 6 * 14


def with_boot(msg: Message, value: float) -> Message:
    for key, space in SPEC.observation.items():
        msg.arrays[f"boot_obs/{key}"] = np.full((1, *space.shape), value, np.float32)
    return msg


def test_the_rollout_holds_a_flushed_chunks_last_step_and_gae_bootstraps_on_its_next_observation():
    buffer = rollout_buffer()  # gamma 0.9
    buffer.insert(chunk("a", 0, 3, version=3))  # without a flush the last step waits
    arrays, info = drain(_InProcess(buffer), "rollout", 3, timeout_s=1.0)
    assert info["kept"] == 2
    buffer = rollout_buffer()
    buffer.insert(with_boot(chunk("a", 0, 3, version=3), 7.0))
    arrays, info = drain(_InProcess(buffer), "rollout", 3, timeout_s=1.0)
    assert info == {"taken": 3, "kept": 3, "stale": 0}
    step = arrays[f"obs/{KEY}"][:, 0]
    last = int(np.flatnonzero(step == 2)[0])
    assert (arrays[f"next_obs/{KEY}"][last] == 7.0).all()
    assert arrays["discount"][last] == pytest.approx(0.9) and not arrays["terminated"][last]

    def value(obs: np.ndarray) -> torch.Tensor:  # a critic: the observation's first entry
        return torch.from_numpy(obs[:, 0].astype(np.float32))

    succ = successors(torch.from_numpy(arrays["row"]), torch.from_numpy(arrays["next_row"]))
    assert int(succ[last]) == -1  # its next step is in the next round
    reward = torch.from_numpy(arrays["reward"])
    adv, _ = gae(
        reward,
        torch.from_numpy(arrays["discount"]),
        value(arrays[f"obs/{KEY}"]),
        value(arrays[f"next_obs/{KEY}"]),
        succ,
        lam=0.5,
    )
    assert float(adv[last]) == pytest.approx(2.0 + 0.9 * 7.0 - 2.0)
    # The episode's next chunk (the next round) continues from there, its steps once.
    buffer.insert(chunk("a", 3, 2, version=4, end="terminated"))
    arrays, info = drain(_InProcess(buffer), "rollout", 4, timeout_s=1.0)
    assert info == {"taken": 2, "kept": 2, "stale": 0}
    assert sorted(arrays[f"obs/{KEY}"][:, 0].tolist()) == [3.0, 4.0]


def test_the_gateways_flush_command_stores_every_step_of_a_held_round(tmp_path):
    """A gateway at its step budget (sync mode's round end) with a worker held: after
    ``flush`` the store holds every recorded step, each env's last with its next observation."""
    from gateway.worker import EnvWorker

    ctx: zmq.Context[Any] = zmq.Context()
    hub = InProcessGateway(tmp_path, ctx)
    control = hub.dealer("control")
    worker_done = threading.Event()
    try:
        hub.gateway.state.max_env_steps = 3 * 11
        hub.start()
        backend = make_backend("counter", num_envs=3, seed=0)
        worker = EnvWorker(backend, hub.gateway.addresses["workers"], uid="counter-w", context=ctx)

        def act() -> None:
            worker.run(max_steps=90)
            worker_done.set()

        threading.Thread(target=act, daemon=True).start()

        def ask(seq: int, **meta: Any) -> dict[str, Any]:
            send(control, Message(MsgType.COMMAND, seq=seq, meta=meta))
            wait_for(lambda: control.poll(0), timeout=10, what=f"the answer to {meta['cmd']}")
            return dict(recv(control).meta)

        wait_for(
            lambda: (
                hub.gateway.state.budget_reached
                and not any(s.awaiting is None for s in hub.gateway.sessions.values())
            ),
            timeout=20,
            what="the worker held at the budget",
        )
        reply = ask(1, cmd="flush")
        assert reply["acting_workers"] == 0 and reply["cut_steps"] > 0
        wait_for(lambda: ask(2, cmd="status")["unacked_chunks"] == 0, timeout=20, what="every chunk stored")
        recorded = hub.gateway.state.env_steps
        store = EpisodeStore(tmp_path / "episodes", readonly=True)
        assert store.count().stored_steps == recorded and store.count().duplicate_steps == 0
        session = hub.gateway.sessions["counter-w"]
        flushed = [c for c in store.chunks() if any(k.startswith("boot_obs/") for k in c.arrays)]
        assert flushed and sum(c.meta["num_steps"] for c in flushed) == reply["cut_steps"]
        for c in flushed:
            for key, held in session.pending_obs.items():
                assert c.arrays[f"boot_obs/{key}"].tolist() == [held[c.meta["env"]].tolist()]
        assert ask(3, cmd="set_budget", max_env_steps=10_000)["max_env_steps"] == 10_000
        wait_for(worker_done.is_set, timeout=20, what="the worker's last steps after the next round opened")
    finally:
        if hub._thread is not None and hub._thread.is_alive():
            hub.stop()
        hub.gateway.close()
        ctx.destroy(linger=0)
