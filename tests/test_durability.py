"""An in-process policy's ACTION leaves before the steps it completes are written, and
nothing is lost for it (:mod:`gateway.hub.durability`).

The gateway side runs a real :class:`~gateway.hub.Gateway` in this process on
``inproc://`` sockets (real recorder, spool and episode store; its loop stopped and
started by the test, so a test queues exactly what it finds); the worker side a real
:class:`~gateway.worker.EnvWorker` against a gateway played by the test on real TCP
sockets. A gateway killed between an ACTION and the write after it is stood in for by
one that never got the observation: its spool is the same either way.
"""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from gateway import steps
from gateway.factory import make_backend
from gateway.protocol import Message, MsgType, decode, pack, recv, send
from gateway.services import free_port
from gateway.store import EpisodeStore
from gateway.worker import EnvWorker
from tests.conftest import time_left, wait_for
from tests.test_hub_inprocess import InProcessGateway
from tests.test_hub_inprocess import hub as hub  # the fixture, by its name

pytestmark = pytest.mark.unit

N = 2
"""Envs of the hand-made worker."""


class Peer:
    """A worker speaking the protocol by hand over one DEALER: observation ``k`` of its
    one episode per env is step ``k - 1``, and from the second on completes a step."""

    def __init__(self, gw: InProcessGateway, uid: str = "w") -> None:
        self.gw, self.uid = gw, uid
        self.sock = gw.dealer("workers")
        self.actions: dict[int, np.ndarray] = {}

    def hello(self) -> None:
        meta = {"uid": self.uid, "num_envs": N, "spec": self.gw.spec.to_dict()}
        send(self.sock, Message(MsgType.HELLO, meta=meta))
        assert self.next().type is MsgType.WELCOME

    def observation(self, seq: int, *, prev: bool = False, replay: bool = False) -> Message:
        obs = {"count": np.full((N, 1), seq, np.float32), "signal": np.zeros((N, 2), np.float32)}
        info = steps.pack(
            episode=np.zeros(N),
            step=float(seq - 1),
            t_capture=time.time(),
            has_prev=float(seq > 1),
            reward=-1.0,
            terminated=0.0,
            truncated=0.0,
            success=0.0,
        )
        arrays = {**pack("obs", obs), "step_info": info}
        if prev:  # the step this observation completes, as a worker keeps it
            before = seq - 1
            arrays["prev/obs/count"] = np.full((N, 1), before, np.float32)
            arrays["prev/obs/signal"] = np.zeros((N, 2), np.float32)
            arrays["prev/action"] = self.actions.get(before, np.zeros((N, 2), np.float32))
            arrays["prev/policy_version"] = np.zeros(N, np.int64)
            arrays["prev/t_action"] = np.full(N, time.time())
            arrays["prev/t_capture"] = np.full(N, time.time())
            arrays["prev/episode"] = np.zeros(N, np.int64)
            arrays["prev/step"] = np.full(N, before - 1, np.int64)
        meta: dict[str, Any] = {"uid": self.uid, **({"replay": True} if replay else {})}
        return Message(MsgType.OBSERVATION, seq=seq, meta=meta, arrays=arrays)

    def send(self, seq: int, **how: bool) -> None:
        send(self.sock, self.observation(seq, **how))

    def next(self) -> Message:
        assert self.sock.poll(int(time_left() * 1000)), "no answer from the gateway"
        msg = recv(self.sock)
        if msg.type is MsgType.ACTION:
            self.actions[msg.seq] = np.array(msg.arrays["action"])
        return msg

    def act(self, seq: int, **how: bool) -> Message:
        self.send(seq, **how)
        reply = self.next()
        assert reply.type is MsgType.ACTION and reply.seq == seq, (reply.type.name, reply.seq, reply.meta)
        return reply


def recorded(gw: InProcessGateway) -> int:
    return int(gw.gateway.recorder.counters.acked_steps)


def test_an_in_process_policys_action_leaves_first_and_the_next_answer_acknowledges_its_steps(hub):
    hub.start()
    peer = Peer(hub)
    peer.hello()
    first = peer.act(1)
    assert first.meta["acked"] == 0 and first.meta["through"] == 1  # nothing to write
    second = peer.act(2)  # completes N steps: answered before they are written
    assert second.meta["acked"] == 0 and second.meta["through"] == 1
    wait_for(lambda: recorded(hub) == N, what="the steps written right after the ACTION")
    third = peer.act(3)
    assert third.meta["acked"] == N and third.meta["through"] == 2
    peer.sock.close()


def test_steps_the_disk_refused_after_their_action_left_are_written_before_anything_else(hub):
    hub.start()
    peer = Peer(hub)
    peer.hello()
    peer.act(1)
    spool = hub.gateway.recorder._spool
    append = spool.append
    full = {"now": True}

    def refuse(msg: Message) -> Any:
        if full["now"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return append(msg)

    spool.append = refuse
    second = peer.act(2)  # left before the write, which the disk refuses
    assert second.meta["through"] == 1
    wait_for(lambda: hub.gateway.recorder.spool_error is not None, what="the refused write")
    peer.send(3)
    bad = peer.observation(4)
    bad.arrays["step_info"] = bad.arrays["step_info"][:, :3]  # malformed, queued behind 3
    send(peer.sock, bad)
    time.sleep(0.5)  # several turns and ticks of the loop: observation 3 must wait
    assert not peer.sock.poll(0), "an observation was answered while earlier steps were unwritten"
    assert recorded(hub) == 0 and hub.gateway.hold_reason() == "storage"
    full["now"] = False  # the disk takes writes again: observation 2's steps go first
    third = peer.next()
    assert third.type is MsgType.ACTION and third.seq == 3, third.meta
    assert third.meta["acked"] == N and third.meta["through"] == 2
    refused = peer.next()  # the malformed one: its error, and the loop goes on
    assert refused.type is MsgType.ERROR and refused.meta["code"] == "bad_request", refused.meta
    assert "step_info" in refused.meta["message"]
    wait_for(lambda: recorded(hub) == 2 * N, what="observation 3's steps written after its ACTION")
    assert peer.act(4).meta["through"] == 3  # the right observation 4, answered as usual
    peer.sock.close()


def test_a_restarted_gateway_records_replayed_steps_once_and_answers_none_of_them(tmp_path: Path):
    ctx: zmq.Context[Any] = zmq.Context()
    old = InProcessGateway(tmp_path, ctx)
    new: InProcessGateway | None = None
    try:
        old.start()
        peer = Peer(old)
        peer.hello()
        for seq in (1, 2, 3):
            peer.act(seq)
        wait_for(lambda: recorded(old) == 2 * N, what="observations 2 and 3's steps written")
        old.stop()
        old.gateway.close()
        # ACTION 4 reached the worker but the gateway died before writing the steps it
        # completes: this one never got observation 4, so its spool is the same.
        peer.actions[4] = np.full((N, 2), 0.5, np.float32)
        peer.sock.close()
        new = InProcessGateway(tmp_path, ctx)
        base = recorded(new)  # what it recovered from the spool
        new.start()
        peer = Peer(new)
        peer.actions[4] = np.full((N, 2), 0.5, np.float32)
        peer.hello()
        peer.send(3, prev=True, replay=True)  # written already: stored once
        peer.send(4, prev=True, replay=True)  # never written: recorded now
        reply = peer.act(5, prev=True)  # the current one: the only answer
        # Both replays acknowledged (the one the spool had counts again, stored once).
        assert reply.meta["through"] == 4 and reply.meta["acked"] == 2 * N
        wait_for(lambda: recorded(new) == base + 2 * N, what="the replayed and the current steps written")
        assert not peer.sock.poll(200), "a replay was answered"
        send(peer.sock, Message(MsgType.BYE, meta={"uid": "w"}))
        wait_for(lambda: not new.gateway.sessions, what="the worker's goodbye")
        send(control := new.dealer("control"), Message(MsgType.COMMAND, seq=1, meta={"cmd": "drain"}))
        wait_for(lambda: control.poll(0), timeout=30, what="the drain's answer")
        assert recv(control).meta["drained"]
        count = EpisodeStore(tmp_path / "episodes", readonly=True).count()
        assert count.stored_steps == 4 * N and count.duplicate_steps == 0, count
        control.close()
        peer.sock.close()
    finally:
        for made in (old, new):
            if made is not None and made._thread is not None and made._thread.is_alive():
                made.stop()
        if new is not None:
            new.gateway.close()
        ctx.destroy(linger=0)


class StandInGateway:
    """The gateway's side played by the test on a real TCP socket: WELCOME to a HELLO,
    then whatever the test sends."""

    def __init__(self, address: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.linger = 0
        # The port of a gateway closed just before is released by ZeroMQ's I/O thread a
        # moment later: bind again until it is free.
        wait_for(lambda: self._bind(address), timeout=10, what=f"{address} to be free again")

    def _bind(self, address: str) -> bool:
        try:
            self.sock.bind(address)
        except zmq.ZMQError:
            return False
        return True

    def expect(self, kind: MsgType) -> tuple[bytes, Message]:
        while True:
            assert self.sock.poll(int(time_left() * 1000)), f"no {kind.name} from the worker"
            frames = self.sock.recv_multipart()
            msg = decode(frames[1:])
            if msg.type is not MsgType.HEARTBEAT:
                assert msg.type is kind, (msg.type.name, msg.seq, msg.meta)
                return frames[0], msg

    def welcome(self) -> bytes:
        route, hello = self.expect(MsgType.HELLO)
        send(
            self.sock, Message(MsgType.WELCOME, seq=hello.seq, meta={"uid": hello.meta["uid"]}), route=[route]
        )
        return route

    def answer(self, route: bytes, seq: int, through: int) -> None:
        meta = {"acked": 0, "through": through, "version": 0, "t_action": time.time()}
        action = np.zeros((N, 2), np.float32)
        send(self.sock, Message(MsgType.ACTION, seq=seq, meta=meta, arrays={"action": action}), route=[route])


def test_a_worker_replays_the_step_no_answer_acknowledged_before_its_current_one():
    address = f"tcp://127.0.0.1:{free_port()}"
    first = StandInGateway(address)
    backend = make_backend("counter", num_envs=N, seed=0, options={"max_episode_steps": 1000})
    worker = EnvWorker(backend, address, uid="kept", heartbeat_s=0.1, gateway_timeout_s=0.5)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        route = first.welcome()
        for seq, through in ((1, 1), (2, 1)):  # observation 2's steps not acknowledged
            _, obs = first.expect(MsgType.OBSERVATION)
            assert obs.seq == seq
            first.answer(route, seq, through)
        _, third = first.expect(MsgType.OBSERVATION)
        assert third.seq == 3
        first.sock.close()  # dies before answering observation 3
        second = StandInGateway(address)
        route = second.welcome()
        _, replay = second.expect(MsgType.OBSERVATION)
        assert replay.seq == 2 and replay.meta.get("replay") is True, replay.meta
        assert "prev/action" in replay.arrays  # the step it completes travels with it
        _, current = second.expect(MsgType.OBSERVATION)
        assert current.seq == 3 and not current.meta.get("replay") and "prev/action" in current.arrays
        second.answer(route, 3, through=3)  # acknowledges both
        _, fourth = second.expect(MsgType.OBSERVATION)
        assert fourth.seq == 4 and worker._unacked == []
        second.sock.close()
    finally:
        worker.stop_event.set()
        thread.join(timeout=10)
        backend.close()
