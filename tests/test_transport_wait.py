"""``gateway.transport.wait_readable``: waits on real ZeroMQ sockets to the microsecond.

``zmq.poll`` counts whole milliseconds; the inference server waits for a batch's
company with this instead, for waits under one. These tests check what it answers, not
how fast (that is the benchmarks' business): a message already there, one that comes
during the wait, on any of several sockets, and none at all.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from gateway.transport import inproc_address, wait_readable


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any], zmq.Socket[Any]]]:
    """A ROUTER with one DEALER connected over TCP, and an idle PULL socket beside it."""
    ctx = zmq.Context.instance()
    router, dealer, idle = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER), ctx.socket(zmq.PULL)
    for sock in (router, dealer, idle):
        sock.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    idle.bind(inproc_address("idle"))
    try:
        yield router, dealer, idle
    finally:
        for sock in (router, dealer, idle):
            sock.close(linger=0)


def test_nothing_to_read_ends_the_wait_false(pair):
    router, _, idle = pair
    assert wait_readable([idle, router], 0.02) is False
    assert wait_readable([idle, router], 0.0) is False


def test_a_message_already_queued_is_seen_and_left_for_the_reader(pair):
    router, dealer, idle = pair
    dealer.send(b"hello")
    assert router.poll(10_000)  # arrived
    assert wait_readable([idle, router], 0.0005) is True
    assert router.recv_multipart()[1] == b"hello"  # still there: only looked at


def test_a_message_arriving_during_the_wait_is_seen(pair):
    """A message that comes while the wait runs ends it with True."""
    router, dealer, idle = pair
    dealer.send(b"warm-up")  # the TCP connection is up before the wait starts
    assert router.poll(10_000)
    router.recv_multipart()
    sender = threading.Timer(0.05, lambda: dealer.send(b"late"))
    sender.start()
    try:
        assert wait_readable([idle, router], 20.0) is True
    finally:
        sender.join()
    assert router.recv_multipart()[1] == b"late"


def test_a_socket_that_was_read_dry_waits_again(pair):
    """The sockets' descriptors are edge-triggered: reading every message leaves nothing
    readable, and the next wait must not take the old edge for a new message."""
    router, dealer, idle = pair
    for i in range(3):
        dealer.send(b"%d" % i)
    for _ in range(3):
        assert router.poll(10_000)
        router.recv_multipart()
    assert wait_readable([idle, router], 0.02) is False


def test_descriptors_past_selects_limit_wait_in_whole_milliseconds(pair, monkeypatch):
    """``select`` refuses descriptors from ``FD_SETSIZE`` on (a process with many open
    files): the wait falls back to ``zmq.poll`` and still answers both ways."""
    import gateway.transport as transport

    router, dealer, idle = pair
    monkeypatch.setattr(transport, "SELECT_FD_LIMIT", 0)  # every descriptor is past it
    assert wait_readable([idle, router], 0.0005) is False
    sender = threading.Timer(0.05, lambda: dealer.send(b"late"))
    sender.start()
    try:
        assert wait_readable([idle, router], 20.0) is True
    finally:
        sender.join()
    assert router.recv_multipart()[1] == b"late"


def test_an_inproc_address_is_never_reused_so_a_bind_right_after_a_close_succeeds():
    """ZeroMQ releases a closed socket's inproc name later, on its reaper thread: a name
    taken from an object (``id(self)``), which a new object may reuse, failed to bind
    ("Address already in use") on a busy machine. Fresh names never collide."""
    ctx = zmq.Context.instance()
    names = set()
    for _ in range(200):
        sock = ctx.socket(zmq.PULL)
        address = inproc_address("idle")
        sock.bind(address)
        sock.close(linger=0)
        names.add(address)
    assert len(names) == 200
