"""The gateway in this process: a real :class:`~gateway.hub.Gateway` on ``inproc://``
sockets, with the real recorder, spool and episode store, and the ``counter`` backend.

``inproc`` hands a message to the peer's queue when ``send`` returns, so a test can
queue exactly what the gateway will find on its next loop turn.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from gateway import steps
from gateway.config import GatewayConfig
from gateway.factory import experiment_spec, make_backend
from gateway.hub import Gateway
from gateway.metrics import HOPS
from gateway.policies import InProcessSource, make_policy
from gateway.protocol import Message, MsgType, pack, recv, send
from gateway.recorder import Recorder
from gateway.store import EpisodeStore, StoreSink
from sim_bridges.counter import CounterBackend, CounterConfig
from tests.conformance.episode_backend import EpisodeBackendConformance
from tests.conftest import wait_for

pytestmark = pytest.mark.unit


class TestCounterConformance(EpisodeBackendConformance):
    def make_backend(self, num_envs: int, seed: int, *, max_episode_steps: int | None = None) -> Any:
        options = {} if max_episode_steps is None else {"max_episode_steps": max_episode_steps}
        return make_backend("counter", num_envs=num_envs, seed=seed, options=options)


class InProcessGateway:
    """A gateway serving in a thread of this process; ``stop()`` ends its loop."""

    def __init__(self, tmp: Path, ctx: zmq.Context[Any]) -> None:
        self.ctx, self.name = ctx, uuid.uuid4().hex[:8]
        self.spec = experiment_spec("counter", {})
        recorder = Recorder(tmp / "spool", StoreSink(EpisodeStore(tmp / "episodes")))
        recorder.recover()
        self.gateway = Gateway(
            config=GatewayConfig(),
            source=InProcessSource(make_policy("random", self.spec, {}, seed=0)),
            recorder=recorder,
            spec=self.spec,
            addresses={k: f"inproc://{self.name}-{k}" for k in ("workers", "clients", "control")},
            context=ctx,
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self.gateway.run, kwargs={"stop": self._stop}, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(timeout=10)
        assert not self._thread.is_alive()

    def dealer(self, name: str) -> zmq.Socket[Any]:
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.sndhwm = 0
        sock.rcvhwm = 0
        sock.connect(self.gateway.addresses[name])
        return sock


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[InProcessGateway]:
    ctx: zmq.Context[Any] = zmq.Context()
    made = InProcessGateway(tmp_path, ctx)
    try:
        yield made
    finally:
        if made._thread is not None and made._thread.is_alive():
            made.stop()
        made.gateway.close()
        ctx.destroy(linger=0)  # closes the test's own sockets too, however the test ended


def observation(seq: int, num_envs: int) -> Message:
    """A worker's first observation of fresh episodes (it completes no step)."""
    obs = {"count": np.zeros((num_envs, 1), np.float32), "signal": np.zeros((num_envs, 2), np.float32)}
    info = steps.pack(
        episode=0, step=0, t_capture=0.0, has_prev=0, reward=0.0, terminated=0, truncated=0, success=0
    )
    info = np.repeat(info, num_envs, axis=0)
    return Message(
        MsgType.OBSERVATION, seq=seq, meta={"uid": "w"}, arrays={**pack("obs", obs), "step_info": info}
    )


def replies(sock: zmq.Socket[Any]) -> list[Message]:
    out = []
    while sock.poll(0):
        out.append(recv(sock))
    return out


def test_an_estop_behind_ten_thousand_queued_observations_is_applied_before_any_is_answered(hub):
    worker, control = hub.dealer("workers"), hub.dealer("control")
    hub.start()
    send(worker, Message(MsgType.HELLO, seq=1, meta={"uid": "w", "num_envs": 2, "spec": hub.spec.to_dict()}))
    wait_for(lambda: worker.poll(0), what="WELCOME")
    assert recv(worker).type is MsgType.WELCOME
    hub.stop()
    # With the loop stopped, queue a flood of observations and then the e-stop.
    flood = 10_000
    for seq in range(2, flood + 2):
        send(worker, observation(seq, 2), flags=zmq.NOBLOCK)
    send(control, Message(MsgType.COMMAND, seq=1, meta={"cmd": "estop", "engaged": True, "reason": "test"}))
    # The control socket's own thread applies and answers it, loop or no loop; started
    # before that answer, the loop could answer observations first.
    wait_for(lambda: control.poll(0), timeout=30, what="the e-stop's answer from the control line")
    assert recv(control).meta["estopped"] is True
    hub.start()
    session = hub.gateway.sessions["w"]
    wait_for(lambda: session.last_seq == flood + 1, timeout=60, what="every queued observation handled")
    got = replies(worker)
    assert [m.type for m in got] == [MsgType.COMMAND], [m.type.name for m in got]  # no ACTION left
    assert got[0].meta == {"cmd": "estop", "engaged": True, "reason": "test", "epoch": 1}
    # Releasing answers the newest observation only: the worker moves on from there.
    send(control, Message(MsgType.COMMAND, seq=2, meta={"cmd": "estop", "engaged": False}))
    wait_for(lambda: worker.poll(0), what="the action after the release")
    released = replies(worker)
    actions = [m for m in released if m.type is MsgType.ACTION]
    assert [m.seq for m in actions] == [flood + 1], [(m.type.name, m.seq) for m in released]
    worker.close()
    control.close()


def test_an_estop_is_answered_and_reaches_the_workers_while_the_loop_is_busy(hub):
    """The gateway's loop stopped stands for one stuck in a long turn (a chunk of camera
    frames gathered, a spool segment rolled): the control socket's own thread takes the
    e-stop, answers it and puts it on the bus the worker listens to, and the worker hands
    it to its backend; a release waits for the loop, and a later e-stop supersedes a
    release the loop has not handled yet."""
    from gateway.worker import EnvWorker

    hub.start()
    backend = make_backend("counter", num_envs=2, seed=0)
    worker = EnvWorker(backend, hub.gateway.addresses["workers"], uid="bus-w", context=hub.ctx)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: hub.gateway.state.env_steps >= 20, timeout=30, what="collection started")
        hub.stop()  # the loop serves nothing from here on
        control = hub.dealer("control")
        send(control, Message(MsgType.COMMAND, seq=1, meta={"cmd": "estop", "reason": "busy loop"}))
        wait_for(lambda: control.poll(0), timeout=10, what="the e-stop's answer from the control line")
        reply = recv(control)
        assert reply.type is MsgType.REPLY and reply.meta["estopped"] is True, reply
        wait_for(lambda: backend.estopped, timeout=10, what="the worker's backend to take the e-stop")
        assert hub.gateway.state.estopped
        # A release goes to the loop, which is not running; a second e-stop overtakes it.
        send(control, Message(MsgType.COMMAND, seq=2, meta={"cmd": "estop", "engaged": False}))
        send(control, Message(MsgType.COMMAND, seq=3, meta={"cmd": "estop", "reason": "again"}))
        wait_for(lambda: control.poll(0), timeout=10, what="the second e-stop's answer")
        answer = recv(control).meta
        assert isinstance(answer.pop("t_engaged"), float)  # when it took effect (unix s)
        assert answer == {"estopped": True, "workers": 1, "epoch": 3}
        hub.start()
        wait_for(lambda: control.poll(0), timeout=10, what="the release's answer from the loop")
        released = recv(control)
        assert released.seq == 2 and released.meta["superseded"] is True, released.meta
        assert hub.gateway.state.estopped and backend.estopped
        # A release that is the newest command lifts it, on the gateway and the worker.
        send(control, Message(MsgType.COMMAND, seq=4, meta={"cmd": "estop", "engaged": False}))
        wait_for(lambda: control.poll(0), timeout=10, what="the release's answer")
        assert recv(control).meta["estopped"] is False
        wait_for(lambda: not backend.estopped, timeout=10, what="the worker's backend released")
        held = hub.gateway.state.env_steps
        wait_for(lambda: hub.gateway.state.env_steps > held + 10, timeout=30, what="collection resumed")
        control.close()
    finally:
        worker.stop_event.set()
        thread.join(timeout=30)


def test_the_hub_records_a_counter_workers_steps_in_process(hub, tmp_path):
    """The whole recording path in one process: acknowledged steps reach the store."""
    from gateway.worker import EnvWorker

    hub.start()
    backend = make_backend("counter", num_envs=3, seed=0)
    worker = EnvWorker(backend, hub.gateway.addresses["workers"], uid="counter-w", context=hub.ctx)
    worker.run(max_steps=120)
    # Its BYE closes its open episodes (as interrupted, their steps kept).
    wait_for(lambda: not hub.gateway.sessions, what="the worker's goodbye handled")
    assert hub.gateway.state.env_steps >= worker.acked_steps > 0
    send(control := hub.dealer("control"), Message(MsgType.COMMAND, seq=1, meta={"cmd": "drain"}))
    wait_for(lambda: control.poll(0), timeout=30, what="the drain's answer")
    final = recv(control).meta
    hub.stop()
    count = EpisodeStore(tmp_path / "episodes", readonly=True).count()
    assert final["drained"] and count.stored_steps == final["acked_steps"] == hub.gateway.state.env_steps
    # Every hop of a step was timed, the worker's own ones reported back with its observations.
    hops = final["hops_us"]
    assert set(hops) == set(HOPS), sorted(hops)
    assert all(h["n"] > 0 and h["p50"] >= 0 for h in hops.values())
    assert hops["gateway"]["n"] >= hops["policy"]["n"] > 0
    assert count.completed_episodes >= 3 and count.duplicate_steps == 0
    control.close()


class SwitchableSink(StoreSink):
    """The real local store, reporting ``blocked`` while ``refusing`` is set: it stands for
    a replay service whose rate limiter refuses inserts until a trainer samples."""

    refusing = False

    @property
    def blocked(self) -> bool:
        return self.refusing or super().blocked


def test_an_evaluation_round_runs_through_backpressure_that_holds_training_collection(tmp_path):
    """A trainer that samples slowly holds collection through the replay rate limiter;
    its evaluation rounds (whose steps never reach a table) must not wait on it, or the
    untrained policy's score arrives only when the update budget is nearly spent."""
    from gateway.worker import EnvWorker

    ctx: zmq.Context[Any] = zmq.Context()
    hub = InProcessGateway(tmp_path, ctx)
    sink = SwitchableSink(EpisodeStore(tmp_path / "blocked-episodes"))
    hub.gateway.recorder.sink = sink
    worker = None
    try:
        hub.start()
        backend = make_backend("counter", num_envs=2, seed=0)
        worker = EnvWorker(backend, hub.gateway.addresses["workers"], uid="held-w", context=ctx)
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        wait_for(lambda: hub.gateway.state.env_steps >= 20, timeout=30, what="collection started")
        sink.refusing = True
        wait_for(lambda: hub.gateway.hold_reason() == "backpressure", timeout=10, what="the hold")
        before = hub.gateway.state.env_steps
        control = hub.dealer("control")
        send(control, Message(MsgType.COMMAND, seq=1, meta={"cmd": "evaluate", "episodes": 4}))
        wait_for(lambda: control.poll(0), timeout=10, what="the evaluation's start")
        assert recv(control).meta["started"] is True
        wait_for(
            lambda: hub.gateway.evaluator.status()["rounds_done"] == 1,
            timeout=60,
            what="the evaluation round finished under backpressure",
        )
        assert hub.gateway.state.env_steps > before
        # Once the round is over, the hold applies again.
        assert hub.gateway.hold_reason() == "backpressure"
        sink.refusing = False
        worker.stop_event.set()
        thread.join(timeout=30)
        assert not thread.is_alive()
        control.close()
    finally:
        if worker is not None:
            worker.stop_event.set()
        if hub._thread is not None and hub._thread.is_alive():
            hub.stop()
        hub.gateway.close()
        ctx.destroy(linger=0)


class PacedCounter(CounterBackend):
    """Counters that take ``STEP_S`` a step, so that an evaluation episode (20 steps) lasts
    long enough for a second worker to arrive while it runs."""

    STEP_S = 0.02

    def step(self, action: Any) -> Any:
        time.sleep(self.STEP_S)
        return super().step(action)


def test_under_backpressure_a_round_holds_the_workers_it_does_not_need(hub, tmp_path):
    """Backpressure lifts for an evaluation round only where the round needs it: once its
    episodes are handed out, a worker with none of them waits for the sink like the rest
    of training collection. Stepped on, its training steps would pass the replay's rate
    limiter in a lump, and collection would then wait while the trainer used up data of
    older policy versions."""
    from gateway.worker import EnvWorker

    ctx = hub.ctx
    sink = SwitchableSink(EpisodeStore(tmp_path / "blocked-episodes"))
    hub.gateway.recorder.sink = sink
    address = hub.gateway.addresses["workers"]
    runs: list[tuple[Any, threading.Thread]] = []

    def start(worker: Any) -> Any:
        runs.append((worker, threading.Thread(target=worker.run, daemon=True)))
        runs[-1][1].start()
        return worker

    try:
        hub.start()
        a = start(EnvWorker(PacedCounter(CounterConfig(), num_envs=2), address, uid="w-a", context=ctx))
        wait_for(lambda: a.env_steps >= 4, timeout=30, what="the first worker collecting")
        sink.refusing = True
        wait_for(lambda: hub.gateway.hold_reason() == "backpressure", timeout=10, what="the hold")
        control = hub.dealer("control")
        send(control, Message(MsgType.COMMAND, seq=1, meta={"cmd": "evaluate", "episodes": 1}))
        wait_for(lambda: control.poll(0), timeout=10, what="the evaluation's start")
        assert recv(control).meta["started"] is True
        evaluator = hub.gateway.evaluator
        wait_for(
            lambda: evaluator.round is not None and evaluator.round.assigned == 1,
            timeout=30,
            what="the round's one episode handed out",
        )
        # A worker that arrives now has no env in the round: it waits with training.
        b = start(EnvWorker(make_backend("counter", num_envs=2, seed=1), address, uid="w-b", context=ctx))
        wait_for(lambda: "w-b" in hub.gateway.sessions, timeout=30, what="the second worker registered")
        wait_for(
            lambda: evaluator.status()["rounds_done"] == 1,
            timeout=60,
            what="the evaluation round finished under backpressure",
        )
        assert b.env_steps == 0
        assert hub.gateway.hold_reason() == "backpressure"
        held_at = a.env_steps
        sink.refusing = False
        wait_for(
            lambda: b.env_steps > 0 and a.env_steps > held_at, timeout=30, what="both workers stepping again"
        )
        control.close()
    finally:  # the workers first: the fixture then stops the gateway and its context
        for worker, _ in runs:
            worker.stop_event.set()
        for _, thread in runs:
            thread.join(timeout=30)
    assert not any(thread.is_alive() for _, thread in runs)


def test_a_round_that_ended_after_the_trainer_stopped_is_recorded_once(tmp_path):
    """Under a small update budget the untrained policy's round can end after the trainer
    stopped polling: the final evaluation records it as the trainer records rounds
    (``updates`` null), once, so the run's records and learning curve have it."""
    from gateway.control_client import ControlClient
    from gateway.metrics import read_metrics
    from gateway.worker import EnvWorker
    from trainer.summary import record_unseen_round

    ctx: zmq.Context[Any] = zmq.Context.instance()  # the control client's own context
    hub = InProcessGateway(tmp_path, ctx)
    backend = make_backend("counter", num_envs=2, seed=0)
    worker = EnvWorker(backend, hub.gateway.addresses["workers"], uid="eval-w", context=ctx)
    thread = threading.Thread(target=worker.run, daemon=True)
    control = ControlClient(hub.gateway.addresses["control"])
    try:
        hub.start()
        thread.start()
        wait_for(lambda: hub.gateway.state.env_steps >= 10, timeout=30, what="collection started")
        assert control.request("evaluate", timeout_s=5.0, episodes=2)["started"]
        wait_for(
            lambda: control.request("status", timeout_s=5.0)["eval"]["rounds_done"] == 1,
            timeout=30,
            what="the evaluation round",
        )
        record_unseen_round(control, tmp_path)
        record_unseen_round(control, tmp_path)  # already recorded: not twice
        (record,) = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r.get("service") == "trainer"]
        assert record["updates"] is None and record["env_steps"] >= 10, record
        assert record["eval"]["round"] == 1 and record["eval"]["episodes"] == 2, record
    finally:
        control.close()
        worker.stop_event.set()
        thread.join(timeout=30)
        if hub._thread is not None and hub._thread.is_alive():
            hub.stop()
        hub.gateway.close()


class EchoPolicy:
    """Acts from the observation itself (``signal``), so a NaN there reaches the action."""

    def __init__(self, spec: Any) -> None:
        from gateway.policies import Policy

        class _Echo(Policy):
            def act(self, obs: Any) -> np.ndarray:
                return np.tanh(np.asarray(obs["signal"], np.float32))

        self.policy = _Echo(spec)


def test_an_observation_the_policy_cannot_act_on_for_its_nan_is_refused_and_the_gateway_goes_on(tmp_path):
    """A NaN in an env's observation gave a NaN action, refused as the policy's fault
    ("action contains NaN or Inf"); with an inference server, which refuses to answer such
    an observation, the gateway asked again forever and the run stalled, saying nothing
    (7 024 retries in 3.5 minutes, in its own log only). The observation is now refused,
    naming the key and the env; other workers go on."""
    ctx: zmq.Context[Any] = zmq.Context()
    hub = InProcessGateway(tmp_path, ctx)
    hub.gateway.source = InProcessSource(EchoPolicy(hub.spec).policy)
    try:
        hub.start()
        bad, good = hub.dealer("workers"), hub.dealer("workers")
        for uid, sock in (("bad", bad), ("good", good)):
            send(
                sock,
                Message(MsgType.HELLO, seq=1, meta={"uid": uid, "num_envs": 2, "spec": hub.spec.to_dict()}),
            )
            wait_for(lambda sock=sock: sock.poll(0), what="WELCOME")
            assert recv(sock).type is MsgType.WELCOME
        nan = observation(2, 2)
        signal = np.zeros((2, 2), np.float32)
        signal[1, 0] = np.nan
        nan.arrays["obs/signal"] = signal
        nan.meta["uid"] = "bad"
        send(bad, nan)
        wait_for(lambda: bad.poll(0), what="the answer to the NaN observation")
        refused = recv(bad)
        assert refused.type is MsgType.ERROR and refused.meta["code"] == "bad_request", refused.meta
        assert "the observation holds NaN or Inf ('signal' in env(s) [1])" in refused.meta["message"]
        send(good, Message(MsgType.OBSERVATION, seq=2, meta={"uid": "good"}, arrays=observation(2, 2).arrays))
        wait_for(lambda: good.poll(0), what="the other worker's action")
        assert recv(good).type is MsgType.ACTION
        assert hub._thread is not None and hub._thread.is_alive()
    finally:
        if hub._thread is not None and hub._thread.is_alive():
            hub.stop()
        hub.gateway.close()
        ctx.destroy(linger=0)
