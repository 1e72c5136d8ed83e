"""What the gateway's replay sink logs while the service holds collection back.

The service is a real ZeroMQ ROUTER in the test's thread, answering each chunk the
sink sends as the replay service's ingest does: ``ERROR rate_limited`` (or ``storage``)
while it refuses, ``CHUNK_ACK`` once it takes chunks again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from gateway.protocol import Limits, Message, MsgType, error_message, recv_routed, send
from tests.conformance.trajectory_sink import episode_chunks
from tests.conftest import wait_for
from trainer.replay.sink import ReplaySink

DEADLINE_S = 20.0
"""Each turn of refusing and taking again must end within this (pytest-timeout: 300 s)."""


@pytest.fixture
def ingest() -> Iterator[tuple[zmq.Socket[Any], str]]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield sock, f"tcp://127.0.0.1:{port}"
    finally:
        sock.close(linger=0)
        ctx.term()


def one_turn(sock: zmq.Socket[Any], sink: ReplaySink, cid: str, code: str) -> None:
    """The service refuses the next chunk it gets with ``code``, then acknowledges
    ``cid`` when the sink sends it again after its back-off."""
    answered: list[str] = []

    def serve() -> bool:
        """One turn of the sink and of the service; whether ``cid`` is acknowledged."""
        sink.tick()
        sink.poll_acks()
        if not sock.poll(5):
            return False
        route, msg, err = recv_routed(sock, Limits())
        assert err is None and msg is not None
        if msg.meta["chunk_id"] != cid:
            return False  # an earlier chunk sent again: answered when its own turn comes
        if not answered:
            answer = error_message(code, "held back by the test", msg.seq)
            answer.meta["chunk_id"] = cid
            answered.append("refused")
        else:
            answer = Message(MsgType.CHUNK_ACK, meta={"ids": [cid]})
            answered.append("acked")
        send(sock, answer, route=[route])
        return answered[-1] == "acked"

    def taken() -> bool:
        sink.poll_acks()
        return not sink.backlog()

    wait_for(serve, DEADLINE_S, interval=0.0, what=f"{cid} refused, then acknowledged")
    wait_for(taken, DEADLINE_S, what="the sink to take the acknowledgement")


def refusal_lines(caplog: pytest.LogCaptureFixture) -> tuple[list[logging.LogRecord], int]:
    refusals = [r for r in caplog.records if "refuses chunks" in r.getMessage()]
    recoveries = sum("acknowledges chunks again" in r.getMessage() for r in caplog.records)
    return refusals, recoveries


def test_a_rate_limiter_holding_collection_back_again_and_again_is_logged_once(ingest, caplog):
    sock, address = ingest
    sink = ReplaySink(address, retry_s=0.01)
    caplog.set_level(logging.INFO, logger="trainer.replay.sink")
    try:
        for chunk in episode_chunks("e1", 12, 2):
            sink.submit(chunk)
            one_turn(sock, sink, chunk.meta["chunk_id"], "rate_limited")
    finally:
        sink.close()
    refusals, recoveries = refusal_lines(caplog)
    assert len(refusals) == 1 and recoveries == 1, [r.getMessage() for r in caplog.records]
    assert refusals[0].levelno == logging.INFO  # the ratio working as configured
    assert sink.counters["refused"] == 6 and sink.counters["acked"] == 6


def test_a_refusal_after_the_quiet_period_or_of_another_kind_is_logged(ingest, caplog, monkeypatch):
    sock, address = ingest
    sink = ReplaySink(address, retry_s=0.01)
    caplog.set_level(logging.INFO, logger="trainer.replay.sink")
    chunks = iter(episode_chunks("e2", 8, 2))
    try:

        def turn(code: str) -> None:
            chunk = next(chunks)
            sink.submit(chunk)
            one_turn(sock, sink, chunk.meta["chunk_id"], code)

        turn("rate_limited")
        turn("rate_limited")  # within the quiet period: counted, not logged
        monkeypatch.setattr(sink.refusal_log, "seconds", 0.0)
        turn("rate_limited")  # the quiet period is over: logged, with the count
        monkeypatch.setattr(sink.refusal_log, "seconds", 30.0)
        turn("storage")  # another kind: logged at once, as a warning
    finally:
        sink.close()
    refusals, recoveries = refusal_lines(caplog)
    assert [r.levelno for r in refusals] == [logging.INFO, logging.INFO, logging.WARNING]
    assert recoveries == 3
    messages = [r.getMessage() for r in refusals]
    assert "more time(s)" not in messages[0] and "more time(s)" not in messages[2], messages
    assert "held back 1 more time(s) since the last such line" in messages[1], messages
