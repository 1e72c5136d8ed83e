"""The gateway with real worker processes over real ZeroMQ sockets on loopback."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import zmq

from gateway.protocol import Message, MsgType, recv, send
from gateway.store import EpisodeStore
from tests.conftest import log_of, wait_for

pytestmark = pytest.mark.integration


def steps(run) -> int:
    return int(run.status()["env_steps"])


def every_worker_stepped(run, workers: int, at_least: int) -> bool:
    """True once ``workers`` workers are registered and each has made ``at_least`` env steps."""
    sessions = run.status()["workers"]
    return len(sessions) == workers and all(s["env_steps"] >= at_least for s in sessions)


def raw_peer(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(address)
    return sock


def test_every_acknowledged_step_reaches_the_store(gateway_run):
    run = gateway_run()
    workers = [run.worker(0), run.worker(1)]
    wait_for(lambda: steps(run) >= 600, what="600 env steps")
    final = run.drain()
    assert all(w.poll() is None for w in workers)
    count = EpisodeStore(run.run_dir / "episodes", readonly=True).count()
    assert final["acked_steps"] == count.stored_steps >= 600
    assert count.duplicate_steps == 0
    assert count.completed_episodes >= 8  # 50-step episodes, 8 envs


def test_a_worker_whose_spec_differs_is_refused_with_the_difference(gateway_run):
    run = gateway_run()
    worker = run.worker(0, "--option", "max_episode_steps=20")
    assert worker.wait(timeout=60) == 2
    text = log_of(worker)
    assert "spec_mismatch" in text and "episode limit 20 != 50" in text
    assert run.status()["errors"]["spec_mismatch"] >= 1


def test_unknown_backend_is_a_clear_error_naming_the_field(procs, tmp_path):
    proc = procs.spawn("-m", "gateway.worker", "--connect", "tcp://127.0.0.1:1", "--backend", "warp_drive")
    assert proc.wait(timeout=60) == 2
    assert "unknown backend 'warp_drive'" in log_of(proc)


def test_worker_killed_mid_episode_leaves_interrupted_episodes_with_their_steps(gateway_run):
    # Episodes far longer than the steps before the kill, so the kill is surely mid-episode.
    run = gateway_run(
        {
            "env": {"backend": "mujoco_reach", "num_envs": 4, "options": {"max_episode_steps": 2000}},
            "policy": {"kind": "random"},
        }
    )
    victim, survivor = run.worker(0), run.worker(1)
    wait_for(lambda: every_worker_stepped(run, 2, 100), what="both workers stepping before the kill")
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    wait_for(
        lambda: run.status()["episodes_interrupted"] >= 4, timeout=30, what="episodes closed as interrupted"
    )
    before = steps(run)
    wait_for(lambda: steps(run) >= before + 100, what="the other worker to keep going")
    assert survivor.poll() is None
    final = run.drain()
    store = EpisodeStore(run.run_dir / "episodes", readonly=True)
    interrupted = [e for e in store.episodes() if e.end == "interrupted"]
    assert len(interrupted) >= 4 and all(e.num_steps > 0 for e in interrupted)
    count = store.count()
    assert count.stored_steps == final["acked_steps"] and count.duplicate_steps == 0


def test_gateway_killed_and_restarted_workers_reconnect_nothing_lost_or_doubled(gateway_run):
    run = gateway_run()
    workers = [run.worker(0), run.worker(1)]
    # Both workers must be streaming before the kill (on a loaded machine one can
    # make all the steps while the other still starts), and both must come back.
    wait_for(lambda: every_worker_stepped(run, 2, 200), what="both workers stepping before the kill")
    run.kill()
    run.start()
    acked_before = run.status()["acked_steps"]
    assert acked_before >= 400  # recovered from the spool
    wait_for(
        lambda: every_worker_stepped(run, 2, 200), timeout=60, what="both workers to reconnect and continue"
    )
    assert all(w.poll() is None for w in workers), "workers must reconnect by themselves, not restart"
    final = run.drain()
    count = EpisodeStore(run.run_dir / "episodes", readonly=True).count()
    assert count.stored_steps == final["acked_steps"]
    assert count.duplicate_steps == 0
    assert sum("reconnecting" in log_of(w) or "registering again" in log_of(w) for w in workers) == 2


def test_curve_keys_admit_the_right_peer_and_refuse_others(gateway_run, tmp_path):
    from gateway.transport import make_keys

    keys = make_keys(tmp_path / "keys")
    run = gateway_run(
        {
            "env": {"backend": "mujoco_reach", "num_envs": 2},
            "policy": {"kind": "random"},
            "gateway": {"curve_keys": str(keys)},
        }
    )
    worker = run.worker(0)
    wait_for(lambda: steps(run) >= 100, what="a keyed worker streaming")
    hello = Message(MsgType.HELLO, meta={"uid": "intruder", "num_envs": 1, "spec": {}})
    plain = raw_peer(run.endpoints["workers"])
    wrong = zmq.Context.instance().socket(zmq.DEALER)
    wrong.linger = 0
    pub, sec = zmq.curve_keypair()
    wrong.curve_publickey, wrong.curve_secretkey = pub, sec
    wrong.curve_serverkey = (keys / "server.key").read_bytes().split(b'public-key = "')[1].split(b'"')[0]
    wrong.connect(run.endpoints["workers"])
    try:
        for peer in (plain, wrong):
            # A DEALER whose handshake was refused may have no pipe to queue on;
            # then the send itself is refused, which is as good as no answer.
            peer.sndtimeo = 1000
            try:
                send(peer, hello)
            except zmq.Again:
                continue
            assert not peer.poll(1500), "a peer without an authorized key got an answer"
    finally:
        plain.close()
        wrong.close()
    assert worker.poll() is None
    assert [w["uid"] for w in run.status()["workers"]] == [run.status()["workers"][0]["uid"]]


def test_binding_beyond_loopback_without_keys_is_refused():
    from gateway.transport import bind

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    try:
        with pytest.raises(ValueError, match="CURVE"):
            bind(sock, "tcp://0.0.0.0:0")
    finally:
        sock.close(linger=0)


def test_estop_stops_every_worker_and_release_resumes(gateway_run):
    run = gateway_run()
    workers = [run.worker(0), run.worker(1)]
    wait_for(lambda: every_worker_stepped(run, 2, 100), what="two workers streaming")
    reply = run.control.request("estop", engaged=True, reason="operator")
    assert isinstance(reply.pop("t_engaged"), float)  # when it took effect (unix s)
    assert reply == {"estopped": True, "workers": 2, "epoch": 1}
    halted = steps(run)
    time.sleep(1.0)
    # At most the steps already in flight when the stop arrived are recorded after it.
    assert steps(run) - halted <= 2 * 4
    assert run.status()["estopped"] is True
    wait_for(lambda: all("e-stop engaged" in log_of(w) for w in workers), what="workers to see the e-stop")
    run.control.request("estop", engaged=False)
    wait_for(lambda: steps(run) > halted + 200, what="collection to resume after release")


def test_an_engaged_estop_outlives_the_gateway_until_it_is_released(gateway_run):
    """The e-stop is latched: a gateway killed (-9) while it is engaged, and started again
    on the same run folder (``loopgate up`` restarts it), starts e-stopped. Its workers
    reconnect and hear the e-stop again; nothing moves until a release, which removes
    the latch. (Before, the restarted gateway knew nothing of it and the sims moved.)"""
    run = gateway_run()
    workers = [run.worker(0), run.worker(1)]
    wait_for(lambda: every_worker_stepped(run, 2, 100), what="two workers streaming")
    run.control.request("estop", engaged=True, reason="operator")
    latch = run.run_dir / "estop.json"
    wait_for(latch.exists, what="the e-stop latched in the run folder")
    assert json.loads(latch.read_text())["reason"] == "operator"
    # Killed before a worker read it, the first gateway's e-stop is never logged there
    # (that worker takes no step meanwhile: it has no gateway); the count below needs it.
    wait_for(
        lambda: all("e-stop engaged by the gateway" in log_of(w) for w in workers),
        what="the workers to hear the e-stop",
    )
    run.kill()
    run.start()
    assert run.status()["estopped"] is True
    assert "the e-stop is engaged (operator, since " in log_of(run.proc)
    wait_for(lambda: len(run.status()["workers"]) == 2, what="both workers back")
    wait_for(
        lambda: all(log_of(w).count("e-stop engaged by the gateway") >= 2 for w in workers),
        what="the workers to hear the e-stop again from the restarted gateway",
    )
    halted = steps(run)
    time.sleep(1.0)
    assert steps(run) - halted <= 2 * 4  # at most a step in flight per env
    run.control.request("estop", engaged=False, reason="operator")
    assert not latch.exists()
    wait_for(lambda: steps(run) > halted + 200, what="collection to resume after release")


@pytest.mark.unit
@pytest.mark.parametrize("latched", ["{", "[1]", ""])
def test_a_latch_that_cannot_be_read_engages_the_estop(tmp_path, latched):
    """Fail safe: a latch file there at all means an e-stop was engaged."""
    from gateway.hub.estop import ControlLine
    from gateway.hub.state import Collection

    (tmp_path / "estop.json").write_text(latched)
    state = Collection(max_env_steps=None)
    line = ControlLine(
        zmq.Context.instance(), "tcp://127.0.0.1:0", state, sessions=lambda: 0, latch=tmp_path / "estop.json"
    )
    try:
        restored = line.restore()
        assert restored is not None and restored["reason"].startswith("unreadable latch")
        assert state.estopped and state.estop_epoch == 1
        assert line.release(1) and not state.estopped and not (tmp_path / "estop.json").exists()
    finally:
        line.close()


def test_a_pause_is_not_counted_as_round_trip_time(gateway_run):
    """A worker's observation held over a pause gets its action 2 s later; the round trip
    it reports for it measures the pause, so the gateway leaves it out of ``rtt``."""
    import time

    run = gateway_run()
    run.worker(0)
    wait_for(lambda: steps(run) > 100, what="collection")
    run.control.request("pause")
    time.sleep(2.0)
    run.control.request("resume")
    resumed = steps(run)
    wait_for(lambda: steps(run) > resumed + 100, what="collection after the pause")

    def measured() -> dict | None:
        # One round trip per message, not per env step: wait until enough were measured.
        rtt = run.status()["rtt"]
        return rtt if rtt["n"] > 100 else None

    rtt = wait_for(measured, what="100 round trips")
    assert rtt["max"] < 1.5e6, rtt


def test_a_step_completed_after_the_drain_is_neither_recorded_nor_acknowledged(gateway_run):
    """An observation in flight when the run drains completes a step whose episode the drain
    can no longer flush: counting it as acknowledged would report it lost. A raw worker
    makes the timing exact: its first step lands right after the drain."""
    import time

    from gateway import steps as step_info
    from gateway.factory import experiment_spec

    run = gateway_run()
    spec = experiment_spec("mujoco_reach", {})
    peer = raw_peer(run.endpoints["workers"])

    def ask(msg: Message) -> Message:
        send(peer, msg)
        assert peer.poll(5000), f"no answer to {msg.type.name}"
        return recv(peer)

    def observation(seq: int, step: int) -> Message:
        info = step_info.pack(
            episode=0, step=step, t_capture=time.time(), has_prev=float(step > 0),
            reward=0.0, terminated=0.0, truncated=0.0, success=0.0,
        )  # fmt: skip
        arrays = {**{f"obs/{k}": v for k, v in spec.zeros(1).items()}, "step_info": info}
        return Message(MsgType.OBSERVATION, seq=seq, meta={"uid": "probe"}, arrays=arrays)

    try:
        hello = Message(MsgType.HELLO, meta={"uid": "probe", "num_envs": 1, "spec": spec.to_dict()})
        assert ask(hello).type is MsgType.WELCOME
        assert ask(observation(1, 0)).type is MsgType.ACTION  # the action of step 0 is out
        drained = run.drain()
        send(peer, observation(2, 1))  # ... and step 0 completes after the drain
        assert ask(Message(MsgType.HEARTBEAT)).type is MsgType.HEARTBEAT  # handled in order
        status = run.status()
    finally:
        peer.close()
    stored = EpisodeStore(run.run_dir / "episodes", readonly=True).count().stored_steps
    assert status["acked_steps"] == drained["acked_steps"] == stored


def test_collection_pauses_while_the_policy_lags_too_far_behind_the_trainer(gateway_run):
    run = gateway_run()
    run.worker(0)
    wait_for(lambda: steps(run) > 100, what="collection")
    # The in-process policy acts with version 0; a trainer at version 20 with a bound of 4.
    reply = run.control.request("trainer_version", version=20, t=0.0, max_policy_lag=4)
    assert reply["trainer_version"] == 20
    assert run.status()["lag_exceeded"] is True
    halted = steps(run)
    import time

    time.sleep(1.0)
    assert steps(run) - halted <= 4  # the step in flight when it paused, at most
    lag = run.status()["policy_lag"]
    assert lag["max"] >= 20 - 1  # steps recorded while lagging are measured as such
    with pytest.raises(Exception, match="version"):
        run.control.request("trainer_version", version="twenty")
