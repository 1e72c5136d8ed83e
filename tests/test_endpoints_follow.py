"""Peers follow ``endpoints.json`` to a service that restarted at another address.

Real ZeroMQ sockets on two loopback IPs (127.0.0.1 and 127.0.0.2: one machine, two
addresses, as two Ray nodes of this machine have): the "moved" service really binds the
other IP. The services are stand-ins (ROUTER sockets the test answers by hand, as in
``tests/test_inference_client.py``) except where noted; the Ray path end to end is in
``tests/test_ray.py``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from gateway.control_client import ControlClient
from gateway.endpoints import EndpointsFollower, follow_all, lookup, read, write
from gateway.factory import make_backend
from gateway.protocol import Message, MsgType, recv_routed, send
from gateway.worker import EnvWorker
from inference.client import InferenceSource
from inference.weights import WeightsPublisher
from tests.conftest import wait_for
from tests.test_inference_client import obs
from trainer.replay.client import ReplayClient
from trainer.replay.sink import ReplaySink

pytestmark = pytest.mark.unit


class Router:
    """A ROUTER bound on ``host`` (a port the OS picks) that keeps what it receives."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.linger = 0
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.got: list[tuple[bytes, Message]] = []

    def pump(self, answer: Any = None) -> None:
        """Keep every message; answer each with ``answer(msg)`` (a Message or None)."""
        while self.sock.poll(0):
            route, msg, _ = recv_routed(self.sock)
            assert msg is not None
            self.got.append((route, msg))
            reply = answer(msg) if answer is not None else None
            if reply is not None:
                send(self.sock, reply, route=[route])

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
def routers() -> Iterator[Any]:
    made: list[Router] = []

    def make(host: str = "127.0.0.1") -> Router:
        made.append(Router(host))
        return made[-1]

    yield make
    for r in made:
        r.close()


def test_the_follower_hands_back_a_changed_file_once_and_keeps_the_old_one_while_it_is_garbled(
    tmp_path, caplog
):
    path = tmp_path / "endpoints.json"
    write(path, {"replay": {"ingest": "tcp://127.0.0.1:1"}})
    follower = EndpointsFollower(path, interval_s=3600.0)
    assert follower.poll(force=True) is None  # nothing changed since it was read
    write(path, {"replay": {"ingest": "tcp://127.0.0.2:1"}})
    assert follower.poll() is None  # not due yet: the interval bounds how often it reads
    new = follower.poll(force=True)
    assert new is not None and lookup(new, "replay", "ingest") == "tcp://127.0.0.2:1"
    assert follower.poll(force=True) is None and follower.changes == 1
    path.write_text('{"replay": {"ingest": ')  # someone's editor, half-way
    with caplog.at_level(logging.ERROR, logger="gateway.endpoints"):
        assert follower.poll(force=True) is None
        assert follower.poll(force=True) is None
    assert [r.getMessage() for r in caplog.records].count(
        f"{path} does not parse (Expecting value: line 1 column 23 (char 22)); keeping the addresses read before"
    ) == 1
    write(path, {"replay": {"ingest": "tcp://127.0.0.3:1"}})
    assert lookup(follower.poll(force=True) or {}, "replay", "ingest") == "tcp://127.0.0.3:1"
    assert read(tmp_path / "absent.json") == {}
    assert not list(tmp_path.glob(".endpoints.json.*"))  # write() left no temporary file


def test_lookup_names_only_addresses():
    endpoints = {"inference": [{"requests": "tcp://a:1", "autoscaled": True}], "replay": {}}
    assert lookup(endpoints, "inference", 0, "requests") == "tcp://a:1"
    assert lookup(endpoints, "inference", 0, "autoscaled") is None
    assert lookup(endpoints, "inference", 1, "requests") is None
    assert lookup(endpoints, "replay", "ingest") is None
    assert lookup(endpoints, "gateway", "control") is None


def test_a_garbled_file_is_refused_by_read_with_its_name(tmp_path):
    path = tmp_path / "endpoints.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"endpoints\.json: expected a JSON object of endpoints, got list"):
        read(path)


def test_the_gateway_follows_an_inference_server_to_its_new_address_and_its_work_goes_there(routers):
    old = routers("127.0.0.1")
    source = InferenceSource([{"requests": old.address}], heartbeat_s=0.02, replica_timeout_s=30.0)

    def heartbeat(msg: Message) -> Message | None:
        if msg.type is not MsgType.HEARTBEAT:
            return None
        return Message(MsgType.HEARTBEAT, seq=msg.seq, meta={"version": 2})  # echoes seq, as a server does

    try:
        wait_for(
            lambda: (
                source.tick() or old.pump(heartbeat) or (source.results() == [] and source.replicas[0].up)
            ),
            timeout=10,
            interval=0.01,
            what="the server up at its first address",
        )
        source.submit("k", obs(), deadline=1e12)
        wait_for(
            lambda: old.pump(heartbeat) or any(m.type is MsgType.INFER for _, m in old.got),
            timeout=10,
            interval=0.01,
            what="the request at the first address",
        )
        # The old server's last heartbeat answer is still queued on the gateway's socket.
        source.replicas[0].last_ping = 0.0  # a ping goes out now
        source.tick()
        wait_for(lambda: old.pump(heartbeat) or source.replicas[0].sock.poll(0), what="an answer queued")
        old.close()  # the server's node is gone with the request
        new = routers("127.0.0.2")
        moved = follow_all({"inference": [{"requests": new.address}]}, source, None)
        assert moved == [f"inference server 0: {old.address} -> {new.address}"]
        assert source.replicas[0].address == new.address and not source.replicas[0].up
        # That answer (where the disconnect did not discard it) is the old server's: it must
        # not bring the replica up, or the request would go down the old connection, lost.
        assert source.results() == [] and not source.replicas[0].up

        def answer(msg: Message) -> Message | None:
            if msg.type is MsgType.HEARTBEAT:
                return heartbeat(msg)
            rows = len(msg.arrays["obs/x"])
            arrays = {"action": np.zeros((rows, 2), np.float32), "policy_version": np.full(rows, 2)}
            return Message(MsgType.ACTION, seq=msg.seq, meta={"version": 2}, arrays=arrays)

        got: list[Any] = []
        wait_for(
            lambda: source.tick() or new.pump(answer) or got.extend(source.results()) or got,
            timeout=10,
            interval=0.01,
            what="the request answered at the new address",
        )
        assert got[0][0] == "k" and got[0][3] is None
        assert source.follow({"inference": [{"requests": new.address}]}) == []  # unchanged: no move
    finally:
        source.close()


def test_the_sink_follows_the_replay_service_and_every_unacknowledged_chunk_is_delivered_there(routers):
    old = routers("127.0.0.1")
    sink = ReplaySink(old.address, resend_timeout_s=3600.0)
    chunks = [Message(MsgType.TRAJECTORY_CHUNK, meta={"chunk_id": f"c{i}"}) for i in range(3)]
    try:
        for chunk in chunks:
            sink.submit(chunk)
        wait_for(lambda: old.pump() or len(old.got) == 3, timeout=10, interval=0.01, what="3 chunks sent")
        old.close()  # never acknowledged: the service died holding them
        new = routers("127.0.0.2")
        assert sink.follow({"replay": {"ingest": new.address}}) == [
            f"replay ingest: {old.address} -> {new.address}"
        ]

        def ack(msg: Message) -> Message:
            return Message(MsgType.CHUNK_ACK, meta={"ids": [msg.meta["chunk_id"]]})

        acked: set[str] = set()
        wait_for(
            lambda: sink.tick() or new.pump(ack) or acked.update(sink.poll_acks()) or len(acked) == 3,
            timeout=10,
            interval=0.01,
            what="every chunk acknowledged at the new address",
        )
        assert acked == {"c0", "c1", "c2"} and sink.backlog() == 0
        assert "127.0.0.2" in sink.describe()
    finally:
        sink.close()


def test_the_trainer_samples_from_the_replay_service_at_its_new_address(routers):
    old = routers("127.0.0.1")
    client = ReplayClient(old.address, prefetch=2)
    new = routers("127.0.0.2")

    def batch(msg: Message) -> Message:
        return Message(MsgType.REPLY, seq=msg.seq, arrays={"obs/q": np.ones((4, 3), np.float32)})

    answering = threading.Event()

    def serve() -> None:
        while not answering.is_set():
            new.pump(batch)
            answering.wait(0.01)

    thread = threading.Thread(target=serve, daemon=True)
    try:
        client._request({"online": 4}, 5.0)  # in flight at the old address when it moves
        wait_for(
            lambda: old.pump() or old.got, timeout=10, interval=0.01, what="a request at the old address"
        )
        assert client.repoint(new.address) and not client.repoint(new.address)
        thread.start()
        got = client.sample(4, tables="online", timeout_s=5.0)
        assert got["obs/q"].shape == (4, 3)
        assert client.address == new.address
    finally:
        answering.set()
        thread.join(timeout=5)
        client.close()


def test_the_publisher_sends_weights_to_an_inference_server_at_its_new_address(routers):
    old = routers("127.0.0.1")
    publisher = WeightsPublisher([{"weights": old.address}], timeout_s=10.0)
    new = routers("127.0.0.2")
    stop = threading.Event()

    def answer(msg: Message) -> Message:
        return Message(MsgType.REPLY, seq=msg.seq, meta={"version": 7})

    def serve() -> None:
        while not stop.is_set():
            new.pump(answer)
            stop.wait(0.01)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        assert publisher.follow([{"weights": new.address}]) == [
            f"weights of inference server 0: {old.address} -> {new.address}"
        ]
        results = publisher.publish({"w": np.zeros(4, np.float32)}, 7)
        assert [r["address"] for r in results] == [new.address] and results[0]["ok"]
        assert old.got == [] or all(m.type is not MsgType.WEIGHTS for _, m in old.got)
    finally:
        stop.set()
        thread.join(timeout=5)
        publisher.close()


def test_a_control_client_asks_the_gateway_at_its_new_address(routers):
    old, new = routers("127.0.0.1"), routers("127.0.0.2")
    client = ControlClient(old.address)
    stop = threading.Event()

    def answer(msg: Message) -> Message:
        return Message(MsgType.REPLY, seq=msg.seq, meta={"ok": True})

    def serve() -> None:
        while not stop.is_set():
            old.pump(answer)
            new.pump(answer)
            stop.wait(0.01)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        assert client.request("status", timeout_s=5.0) == {"ok": True}
        client.address = new.address
        assert client.request("status", timeout_s=5.0) == {"ok": True}
        assert [m.meta["cmd"] for _, m in old.got] == ["status"]
        assert [m.meta["cmd"] for _, m in new.got] == ["status"]
    finally:
        stop.set()
        thread.join(timeout=5)
        client.close()


def test_a_worker_reads_the_gateways_new_address_when_it_reconnects(tmp_path: Path, routers):
    old, new = routers("127.0.0.1"), routers("127.0.0.2")
    path = tmp_path / "endpoints.json"
    write(path, {"gateway": {"workers": old.address}})
    worker = EnvWorker(make_backend("counter", num_envs=1, seed=0), old.address, endpoints=path)
    try:
        worker._connect()
        assert worker.address == old.address
        write(path, {"gateway": {"workers": new.address}})
        sock = worker._connect()  # what a reconnect after a silent gateway does
        assert worker.address == new.address
        send(sock, Message(MsgType.HEARTBEAT))
        wait_for(
            lambda: new.pump() or new.got, timeout=10, interval=0.01, what="the worker at the new address"
        )
        path.write_text("{")  # half-written: the worker keeps dialling the address it has
        worker._connect()
        assert worker.address == new.address
    finally:
        if worker._sock is not None:
            worker._sock.close(linger=0)
        worker.backend.close()
