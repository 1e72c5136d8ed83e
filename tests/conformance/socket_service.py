"""Conformance suite: every socket service survives garbage.

Whatever a peer sends - frames that are not msgpack, another protocol version, an
announced or real size over the receiver's limits, an unknown message type, a multipart
message with frames missing or extra, a valid message the socket does not take - the
service answers that peer with an ``ERROR`` whose code is the one
:func:`gateway.protocol.decode` (or the service) gives and whose message names the
problem, counts it, and goes on serving: the same peer and every other one, also while
one bad peer floods it. Each socket of each service (the gateway's worker, client and
control sockets, the inference server's, the replay service's) subclasses
:class:`SocketServiceConformance` and supplies a :class:`ServiceUnderTest`::

    class TestMyControlSocket(SocketServiceConformance):
        @pytest.fixture
        def service_under_test(self, my_service):
            return ServiceUnderTest(
                address=my_service.endpoints["control"],
                good_peer=lambda sock: lambda: assert_status_reply(sock),
                alive=lambda: my_service.proc.poll() is None,
                unaccepted=(MsgType.BATCH, "unexpected"),
            )

``good_peer(sock)`` prepares a connected DEALER (a HELLO, say) and returns one
exchange: it sends a good request and asserts that the answer is right.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import pytest
import zmq

from gateway.protocol import DEFAULT_LIMITS, PROTOCOL_VERSION, Limits, Message, MsgType, recv, send
from tests.conftest import time_left

Exchange = Callable[[], None]


@dataclass
class ServiceUnderTest:
    """One socket of a running service, and how to check that it still serves."""

    address: str
    good_peer: Callable[[zmq.Socket[Any]], Exchange]
    """Prepare a connected DEALER; return one good request whose answer it asserts."""
    alive: Callable[[], bool]
    """Whether the service's process is still running."""
    unaccepted: tuple[MsgType, str]
    """A message type this socket does not take from a fresh peer, and the error code for it."""
    errors_counted: Callable[[], int] | None = None
    """The number of refused messages the service reports (its status), if it reports one."""
    limits: Limits = field(default_factory=lambda: DEFAULT_LIMITS)
    """The codec limits the service applies on this socket."""


def _head(**fields: Any) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "t": int(MsgType.HEARTBEAT), **fields})


def garbage(limits: Limits) -> dict[str, tuple[list[bytes], str, str]]:
    """Bad multipart messages: ``name -> (frames, error code, a word the error message names)``."""
    v = PROTOCOL_VERSION
    return {
        "not_msgpack": ([b"\xc1garbage", b"x"], "bad_header", "msgpack"),
        "empty_header": ([b""], "bad_header", "msgpack"),
        "header_not_a_map": ([msgpack.packb([v, 11])], "bad_header", "map"),
        "wrong_version": ([msgpack.packb({"v": v + 7, "t": 11})], "bad_version", str(v + 7)),
        "no_version": ([msgpack.packb({"t": 11})], "bad_version", "version"),
        "unknown_type": ([msgpack.packb({"v": v, "t": 4242})], "unknown_type", "4242"),
        "truncated": (
            [_head(a=[["x", "float32", [8]], ["y", "uint8", [2]]]), b"\0" * 32],
            "truncated",
            "2 arrays",
        ),
        "extra_frames": ([_head(), b"x", b"y"], "truncated", "2 frames"),
        "object_dtype": ([_head(a=[["x", "object", [1]]]), b"\0" * 8], "bad_dtype", "object"),
        "bad_shape": ([_head(a=[["x", "uint8", [-1]]]), b""], "bad_shape", "-1"),
        "length_mismatch": ([_head(a=[["x", "float32", [4]]]), b"\0" * 3], "length_mismatch", "3 bytes"),
        "oversize_array": ([_head(a=[["x", "uint8", [1 << 40]]]), b"x"], "too_large", "limit"),
        "oversize_header": ([b"\xc4" + b"\0" * limits.max_header_bytes], "too_large", "header"),
        "too_many_frames": ([_head()] + [b""] * limits.max_frames, "too_large", "frames"),
    }


@pytest.mark.conformance
class SocketServiceConformance:
    """Tests every socket of every service passes; subclasses supply ``service_under_test``."""

    flood_rounds: ClassVar[int] = 20
    """Rounds of every kind of garbage the flooding peer sends, a good exchange after each."""

    @pytest.fixture
    def service_under_test(self) -> ServiceUnderTest:
        raise NotImplementedError

    @pytest.fixture
    def dealer(self) -> Any:
        """Connected DEALER sockets, closed after the test."""
        socks: list[zmq.Socket[Any]] = []

        def make(address: str) -> zmq.Socket[Any]:
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.linger = 0
            sock.connect(address)
            socks.append(sock)
            return sock

        yield make
        for sock in socks:
            sock.close(linger=0)

    @staticmethod
    def answer(sock: zmq.Socket[Any], what: str) -> Message:
        assert sock.poll(int(min(10.0, time_left()) * 1000)), f"no answer to {what}"
        return recv(sock)

    def assert_error(self, msg: Message, code: str, word: str, what: str) -> None:
        assert msg.type is MsgType.ERROR, f"{what} was answered with {msg.type.name}, not ERROR"
        assert msg.meta.get("code") == code, f"{what}: code {msg.meta.get('code')!r}, expected {code!r}"
        message = str(msg.meta.get("message", ""))
        assert word in message, f"{what}: the error message {message!r} does not name {word!r}"

    # ---------------------------------------------------------------- tests

    @pytest.mark.parametrize("kind", list(garbage(DEFAULT_LIMITS)))
    def test_garbage_is_answered_with_an_error_naming_it_and_the_peer_is_still_served(
        self, service_under_test, dealer, kind
    ) -> None:
        svc = service_under_test
        frames, code, word = garbage(svc.limits)[kind]
        sock = dealer(svc.address)
        before = svc.errors_counted() if svc.errors_counted else 0
        sock.send_multipart(frames)
        self.assert_error(self.answer(sock, kind), code, word, kind)
        assert svc.alive(), f"the service died of {kind}"
        svc.good_peer(sock)()
        if svc.errors_counted:
            assert svc.errors_counted() == before + 1, "the refused message was not counted"

    def test_a_valid_message_this_socket_does_not_take_is_refused_with_its_seq(
        self, service_under_test, dealer
    ) -> None:
        svc = service_under_test
        msg_type, code = svc.unaccepted
        sock = dealer(svc.address)
        send(sock, Message(msg_type, seq=4321))
        answer = self.answer(sock, msg_type.name)
        self.assert_error(answer, code, msg_type.name, msg_type.name)
        assert answer.seq == 4321, "the error does not refer to the message it answers"
        svc.good_peer(sock)()

    def test_a_flood_from_one_bad_peer_leaves_a_good_peer_correctly_served(
        self, service_under_test, dealer
    ) -> None:
        svc = service_under_test
        cases = garbage(svc.limits)
        bad, good = dealer(svc.address), dealer(svc.address)
        exchange = svc.good_peer(good)
        before = svc.errors_counted() if svc.errors_counted else 0
        sent = []
        served = 0
        for _ in range(self.flood_rounds):
            for kind, (frames, _, _) in cases.items():
                bad.send_multipart(frames, flags=zmq.NOBLOCK)
                sent.append(kind)
            exchange()  # asserts the answer is correct
            served += 1
        assert served == self.flood_rounds
        for i, kind in enumerate(sent):
            _, code, word = cases[kind]
            self.assert_error(self.answer(bad, f"flood message {i} ({kind})"), code, word, kind)
        assert not bad.poll(0), "more answers than messages"
        assert svc.alive()
        if svc.errors_counted:
            assert svc.errors_counted() == before + len(sent), "not every refused message was counted"
        exchange()


def fresh_ids(prefix: str) -> Callable[[], str]:
    """Unique names for good requests (chunk ids, worker uids) across tests on one service."""
    counter = itertools.count()
    return lambda: f"{prefix}-{next(counter)}-{time.monotonic_ns()}"
