"""InferenceSource against stand-in servers (real ROUTER sockets the test answers by hand)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq

from gateway.protocol import Message, MsgType, error_message, recv_routed, send
from inference.client import InferenceSource
from tests.conftest import wait_for

pytestmark = pytest.mark.unit


class FakeServer:
    """A ROUTER at a fixed address that records requests and answers when told."""

    def __init__(self, address: str | None = None) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.linger = 0
        if address is None:
            port = self.sock.bind_to_random_port("tcp://127.0.0.1")
            address = f"tcp://127.0.0.1:{port}"
        else:
            self.sock.bind(address)
        self.address = address
        self.requests: list[tuple[bytes, Message]] = []

    def pump(self) -> None:
        """Answer heartbeats, keep requests."""
        while self.sock.poll(0):
            route, msg, _ = recv_routed(self.sock)
            assert msg is not None
            if msg.type is MsgType.HEARTBEAT:
                send(
                    self.sock, Message(MsgType.HEARTBEAT, meta={"version": 3, "queue_rows": 0}), route=[route]
                )
            else:
                self.requests.append((route, msg))

    def answer(self, version: int = 3) -> None:
        for route, msg in self.requests:
            rows = len(msg.arrays["obs/x"])
            arrays = {
                "action": np.zeros((rows, 2), np.float32),
                "policy_version": np.full(rows, version, np.int64),
            }
            send(
                self.sock,
                Message(MsgType.ACTION, seq=msg.seq, meta={"version": version}, arrays=arrays),
                route=[route],
            )
        self.requests.clear()

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
def servers() -> Iterator[list[FakeServer]]:
    made = [FakeServer(), FakeServer()]
    try:
        yield made
    finally:
        for s in made:
            s.close()


def obs(rows: int = 4) -> dict[str, np.ndarray]:
    arr = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    arr.flags.writeable = False  # as the gateway hands them over: views of received frames
    return {"x": arr}


def run_until(source: InferenceSource, servers: list[FakeServer], predicate: Any, what: str) -> Any:
    def step() -> Any:
        source.tick()
        for s in servers:
            s.pump()
        return predicate()

    return wait_for(step, 10, interval=0.01, what=what)


def until_up(source: InferenceSource, servers: list[FakeServer]) -> None:
    def all_up() -> bool:
        source.results()
        return all(r.up for r in source.replicas)

    run_until(source, servers, all_up, "servers up")


def test_equally_idle_servers_take_turns(servers):
    """One request in flight at a time (one worker, answered before it asks again): at
    each request every server is equally idle. They take turns, so a replica the
    autoscaler added for latency gets requests, instead of the first taking them all."""
    source = InferenceSource([s.address for s in servers], heartbeat_s=0.02, replica_timeout_s=5.0)
    picks: list[int] = []
    got: list[Any] = []
    try:
        until_up(source, servers)
        for i in range(6):
            source.submit(i, obs(), time.monotonic() + 10)
            run_until(source, servers, lambda: sum(len(s.requests) for s in servers) == 1, "a request")
            picks.append(next(j for j, s in enumerate(servers) if s.requests))
            for s in servers:
                s.answer()
            run_until(
                source, servers, lambda: got.extend(source.results()) or len(got) == len(picks), "its answer"
            )
        assert sorted(picks.count(j) for j in range(len(servers))) == [3, 3], picks
    finally:
        source.close()


def test_requests_go_to_the_server_with_the_least_outstanding_work(servers):
    source = InferenceSource([s.address for s in servers], heartbeat_s=0.02, replica_timeout_s=5.0)
    try:
        until_up(source, servers)
        for i in range(4):
            source.submit(i, obs(), time.monotonic() + 10)
        run_until(source, servers, lambda: sum(len(s.requests) for s in servers) == 4, "4 requests")
        assert [len(s.requests) for s in servers] == [2, 2]
        servers[0].answer()
        got: list[Any] = []
        run_until(source, servers, lambda: got.extend(source.results()) or len(got) == 2, "2 answers")
        source.submit(9, obs(8), time.monotonic() + 10)  # server 0 is idle now
        run_until(source, servers, lambda: len(servers[0].requests) == 1, "request on the idle server")
        assert all(versions[0] == 3 and error is None for _, _, versions, error in got)
        assert source.version == 3
    finally:
        source.close()


def test_work_of_a_silent_server_is_retried_and_a_returning_server_rejoins(servers):
    source = InferenceSource(
        [s.address for s in servers], heartbeat_s=0.02, replica_timeout_s=0.3, deadline_ms=5000
    )
    try:
        until_up(source, servers)
        for i in range(4):
            source.submit(i, obs(), time.monotonic() + 20)
        run_until(source, servers, lambda: sum(len(s.requests) for s in servers) == 4, "4 requests")
        address = servers[0].address
        servers[0].close()  # dies holding two requests
        run_until(source, servers[1:], lambda: len(servers[1].requests) == 4, "retries on server 1")
        servers[1].answer()
        got: list[Any] = []
        run_until(source, servers[1:], lambda: got.extend(source.results()) or len(got) == 4, "4 answers")
        assert sorted(key for key, *_ in got) == [0, 1, 2, 3]
        assert source.counters["retried"] == 2 and source.counters["failed"] == 0
        assert not source.replicas[0].up

        servers[0] = FakeServer(address)  # back at its address
        run_until(source, servers, lambda: source.results() == [] and source.replicas[0].up, "rejoin")
        for i in range(2):
            source.submit(10 + i, obs(), time.monotonic() + 20)
        run_until(source, servers, lambda: len(servers[0].requests) == 1, "work for the returned server")
    finally:
        source.close()


def test_retryable_errors_go_elsewhere_and_a_passed_gateway_deadline_reports_an_error(servers):
    source = InferenceSource([s.address for s in servers], heartbeat_s=0.02, replica_timeout_s=5.0)
    try:
        until_up(source, servers)
        source.submit("a", obs(), time.monotonic() + 10)
        run_until(source, servers, lambda: any(s.requests for s in servers), "a request")
        first = next(s for s in servers if s.requests)
        other = next(s for s in servers if s is not first)
        route, msg = first.requests.pop()
        send(first.sock, error_message("deadline_exceeded", "too slow", msg.seq), route=[route])
        run_until(source, servers, lambda: source.results() == [] and len(other.requests) == 1, "retry")
        route, msg = other.requests.pop()
        send(other.sock, error_message("bad_request", "no", msg.seq), route=[route])
        got: list[Any] = []
        run_until(source, servers, lambda: got.extend(source.results()) or got, "an error result")
        assert got[0][0] == "a" and got[0][1] is None and "bad_request" in got[0][3]

        source.submit("late", obs(), time.monotonic() + 0.05)  # nobody answers it
        got.clear()
        run_until(source, servers, lambda: got.extend(source.results()) or got, "deadline error")
        assert got[0][0] == "late" and got[0][1] is None
    finally:
        source.close()
