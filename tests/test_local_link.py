"""The worker link on one host: a unix socket beside the gateway's ZeroMQ ROUTER.

Real unix and ZeroMQ sockets in one process for the framing, the routing and the
gateway's writes that never block; real gateway and worker processes for which link a
worker takes, and for a gateway killed and restarted under workers on the link.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import struct
import time

import numpy as np
import pytest
import zmq

from gateway import local_link
from gateway.local_link import HEADER, LinkError, LocalLink, Reader, WorkerSockets, link_name
from gateway.protocol import Limits, Message, MsgType, recv, recv_routed, send
from gateway.protocol.codec import decode, encode, recv_frames
from gateway.store import EpisodeStore
from gateway.transport import readable
from tests.conftest import log_of, time_left, wait_for

LIMITS = Limits(max_frames=16, max_message_bytes=1 << 20)


def framed(msg: Message) -> bytes:
    """``msg`` as the link writes it."""
    frames = [memoryview(f).cast("B") for f in encode(msg)]
    lengths = [f.nbytes for f in frames]
    head = HEADER.pack(4 * len(frames) + sum(lengths), len(frames)) + struct.pack(
        f"<{len(frames)}I", *lengths
    )
    return head + b"".join(f.tobytes() for f in frames)


def observation(seq: int, rows: int = 4) -> Message:
    arrays = {"obs/q": np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) + seq}
    return Message(MsgType.OBSERVATION, seq=seq, meta={"uid": "w"}, arrays=arrays)


@pytest.fixture
def gateway_side():
    """A ROUTER on a free loopback port with the local links beside it."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    address = f"tcp://127.0.0.1:{port}"
    links = WorkerSockets.offer(router, address, "auto", None, LIMITS)
    assert isinstance(links, WorkerSockets)
    try:
        yield links, address
    finally:
        links.close()


@pytest.fixture
def link(gateway_side):
    """A worker's end of the link, with the test's limits."""
    end = LocalLink.connect(gateway_side[1], LIMITS, 5.0)
    try:
        yield end
    finally:
        end.close()


@pytest.fixture
def dealer(gateway_side):
    """A worker's ZeroMQ DEALER on the same gateway."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(gateway_side[1])
    try:
        yield sock
    finally:
        sock.close()


def receive(links: WorkerSockets, timeout_s: float = 10.0):
    wait_for(lambda: readable(links), timeout=timeout_s, interval=0.001, what="a message at the gateway")
    return recv_routed(links, LIMITS)


@pytest.mark.unit
def test_the_reader_cuts_a_stream_into_messages_however_it_arrives():
    stream = b"".join(framed(observation(seq)) for seq in range(1, 6))
    for piece in (1, 7, 64, len(stream)):
        reader = Reader(LIMITS)
        got = []
        for at in range(0, len(stream), piece):
            got.extend(reader.feed(stream[at : at + piece]))
        assert len(got) == 5
        for seq, frames in enumerate(got, start=1):
            from gateway.protocol.codec import BufferFrame, decode

            msg = decode([BufferFrame(f, i < len(frames) - 1) for i, f in enumerate(frames)], LIMITS)
            assert msg.seq == seq
            np.testing.assert_array_equal(msg.arrays["obs/q"], observation(seq).arrays["obs/q"])


@pytest.mark.unit
@pytest.mark.parametrize(
    "header, problem",
    [
        (HEADER.pack(4 * 17, 17), "17 frames"),
        (HEADER.pack(0, 0), "0 frames"),
        (HEADER.pack((2 << 20) + 4, 1), "bytes"),
        (HEADER.pack(4 + 10, 1) + struct.pack("<I", 3), "do not add up"),
    ],
)
def test_a_header_past_the_limits_or_inconsistent_is_refused_before_its_body(header, problem):
    reader = Reader(LIMITS)
    with pytest.raises(LinkError, match=problem):
        reader.feed(header + b"\0" * 10)


@pytest.mark.unit
def test_the_link_is_wanted_only_for_a_local_gateway_without_keys_unless_off():
    assert local_link.wanted("auto", "tcp://127.0.0.1:5555", None)
    assert local_link.wanted("auto", "ipc:///tmp/run/workers.sock", None)
    assert not local_link.wanted("off", "tcp://127.0.0.1:5555", None)
    assert not local_link.wanted("auto", "tcp://10.1.2.3:5555", None)
    assert not local_link.wanted("auto", "tcp://127.0.0.1:5555", object())  # CURVE keys: ZeroMQ
    assert link_name("tcp://127.0.0.1:5555") != link_name("tcp://127.0.0.1:5556")


@pytest.mark.unit
def test_link_and_zmq_workers_share_the_gateways_socket_each_answered_on_its_own(gateway_side, link, dealer):
    links, _ = gateway_side
    send(link, observation(1))
    send(dealer, observation(2))
    routes = {}
    for _ in range(2):
        route, msg, err = receive(links)
        assert err is None and msg is not None
        np.testing.assert_array_equal(msg.arrays["obs/q"], observation(msg.seq).arrays["obs/q"])
        routes[msg.seq] = route
    assert routes[1].startswith(local_link.ROUTE_PREFIX) and routes[2][:1] == b"\0"
    for seq, route in routes.items():
        action = np.full((4, 3), seq, np.float32)
        send(
            links,
            Message(MsgType.ACTION, seq=seq, meta={"acked": seq}, arrays={"action": action}),
            route=[route],
        )
    assert link.poll(5000)
    got = recv(link, LIMITS)
    assert got.seq == 1 and got.meta == {"acked": 1} and (got.arrays["action"] == 1).all()
    assert dealer.poll(5000)
    got = recv(dealer, LIMITS)
    assert got.seq == 2 and (got.arrays["action"] == 2).all()
    assert links.links == 1


@pytest.mark.unit
def test_a_link_message_and_a_zmq_one_waiting_together_arrive_whole(gateway_side, link, dealer):
    links, _ = gateway_side
    send(dealer, observation(2))
    assert links.router.poll(5000)
    send(link, observation(1))
    time.sleep(0.05)  # both wait now
    got = {}
    for _ in range(2):
        frames = recv_frames(links)
        msg = decode(frames[1:], LIMITS)
        got[msg.seq] = frames[0].bytes
        np.testing.assert_array_equal(msg.arrays["obs/q"], observation(msg.seq).arrays["obs/q"])
    assert got[1].startswith(local_link.ROUTE_PREFIX) and got[2][:1] == b"\0"
    assert not readable(links)


@pytest.mark.unit
def test_a_malformed_message_on_the_link_is_answered_and_the_link_goes_on(gateway_side, link):
    links, _ = gateway_side
    link.send_multipart([b"not msgpack"])
    route, msg, err = receive(links)
    assert msg is None and err is not None and err.code.value == "bad_header"
    send(links, Message(MsgType.ERROR, meta={"code": err.code.value}), route=[route])
    assert link.poll(5000) and recv(link, LIMITS).meta["code"] == "bad_header"
    send(link, observation(3))
    _, msg, err = receive(links)
    assert err is None and msg is not None and msg.seq == 3


@pytest.mark.unit
def test_bad_framing_ends_that_connection_only(gateway_side, link, caplog):
    links, address = gateway_side
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(link_name(address))
    try:
        with caplog.at_level(logging.INFO, logger="gateway.local_link"):
            raw.sendall(HEADER.pack(4 * 500, 500) + b"\0" * 64)  # more frames than the limits
            wait_for(
                lambda: (readable(links), "500 frames" in caplog.text)[1], interval=0.001, what="the refusal"
            )
        raw.settimeout(5.0)
        assert raw.recv(10) == b""  # the gateway closed it
        send(link, observation(4))
        _, msg, err = receive(links)
        assert err is None and msg is not None and msg.seq == 4
    finally:
        raw.close()


@pytest.mark.unit
def test_the_gateway_never_blocks_on_a_worker_that_does_not_read(gateway_side, monkeypatch):
    links, address = gateway_side
    link = LocalLink.connect(address, Limits(), 5.0)  # takes the 3 MiB actions below
    try:
        send(link, observation(1))
        route, _, _ = receive(links)
        big = np.random.default_rng(0).standard_normal((1 << 18, 3)).astype(np.float32)  # 3 MiB
        for seq in range(1, 4):
            send(links, Message(MsgType.ACTION, seq=seq, arrays={"action": big}), route=[route])
        assert links.unsent_bytes > 0  # more than the socket holds: the sends returned, the rest waits
        for seq in range(1, 4):
            # The gateway's loop finishes its writes as the socket drains (each turn looks).
            wait_for(
                lambda: (readable(links), link.poll(10))[1],
                timeout=time_left(),
                interval=0,
                what=f"queued action {seq} at the worker",
            )
            got = recv(link, Limits())
            assert got.seq == seq
            np.testing.assert_array_equal(got.arrays["action"], big)
        # A worker that leaves more than the gateway keeps unread loses its connection.
        monkeypatch.setattr(local_link, "MAX_PENDING_BYTES", 4 << 20)
        for seq in range(4, 8):
            send(links, Message(MsgType.ACTION, seq=seq, arrays={"action": big}), route=[route])
        assert links.links == 0
        wait_for(lambda: not link.poll(10) and link.closed, what="the worker to see the link closed")
    finally:
        link.close()


@pytest.mark.unit
def test_a_worker_sees_its_gateway_go_and_nothing_listens_after_it(gateway_side):
    links, address = gateway_side
    link = LocalLink.connect(address, LIMITS, 5.0)
    send(link, observation(1))
    receive(links)
    links.close()
    assert link.poll(5000) == 0 and link.closed
    send(link, observation(2))  # dropped, as ZeroMQ drops for a peer that is gone
    with pytest.raises(OSError):
        LocalLink.connect(address, LIMITS, 5.0)
    link.close()


# ------------------------------------------------------------------ real processes


def link_of(run) -> list[bool]:
    return [w["local_link"] for w in run.status()["workers"]]


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["auto", "off"])
def test_a_worker_on_the_gateways_host_takes_the_link_unless_it_is_off(gateway_run, mode):
    run = gateway_run(
        {
            "env": {"backend": "mujoco_reach", "num_envs": 4},
            "policy": {"kind": "random"},
            "gateway": {"local_link": mode},
        }
    )
    worker = run.worker(0)
    wait_for(lambda: run.status()["env_steps"] >= 200, what="200 env steps")
    assert link_of(run) == [mode == "auto"]
    text = log_of(worker)
    assert ("over its local link" in text) == (mode == "auto")
    final = run.drain()
    count = EpisodeStore(run.run_dir / "episodes", readonly=True).count()
    assert count.stored_steps == final["acked_steps"] >= 200 and count.duplicate_steps == 0


@pytest.mark.integration
def test_workers_on_the_link_outlive_a_killed_gateway_and_lose_nothing(gateway_run):
    """SIGKILL of the gateway under workers on the link: they see the stream end, reconnect
    (over ZeroMQ while nothing listens, over the link again at the next connection) and
    send their unacknowledged steps again; every acknowledged step is stored once."""
    run = gateway_run()
    workers = [run.worker(0), run.worker(1)]
    wait_for(lambda: len(link_of(run)) == 2 and all(link_of(run)), what="both workers on the link")
    wait_for(lambda: all(w["env_steps"] >= 200 for w in run.status()["workers"]), what="both stepping")
    run.kill()
    run.start()
    wait_for(
        lambda: (
            len(run.status()["workers"]) == 2 and all(w["env_steps"] >= 200 for w in run.status()["workers"])
        ),
        timeout=60,
        what="both workers back and stepping",
    )
    assert all(w.poll() is None for w in workers)
    final = run.drain()
    count = EpisodeStore(run.run_dir / "episodes", readonly=True).count()
    assert count.stored_steps == final["acked_steps"] and count.duplicate_steps == 0
    assert all("closed the local link" in log_of(w) for w in workers)


@pytest.mark.integration
def test_a_worker_killed_on_the_link_has_its_episodes_interrupted(gateway_run):
    run = gateway_run(
        {
            "env": {"backend": "mujoco_reach", "num_envs": 4, "options": {"max_episode_steps": 2000}},
            "policy": {"kind": "random"},
        }
    )
    victim = run.worker(0)
    wait_for(lambda: link_of(run) == [True] and run.status()["env_steps"] >= 100, what="stepping on the link")
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    wait_for(
        lambda: run.status()["episodes_interrupted"] >= 4, timeout=30, what="episodes closed as interrupted"
    )
    final = run.drain()
    store = EpisodeStore(run.run_dir / "episodes", readonly=True)
    assert store.count().stored_steps == final["acked_steps"]
    assert all(e.num_steps > 0 for e in store.episodes() if e.end == "interrupted")


@pytest.mark.integration
def test_a_worker_started_before_its_gateway_moves_to_the_link_once_it_listens(gateway_run, procs):
    """Started first, the worker finds no link and dials ZeroMQ; the gateway's WELCOME says it
    has one, and the worker registers again over it before its first step."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    worker = procs.spawn(
        "-m", "gateway.worker", "--connect", f"tcp://127.0.0.1:{port}", "--backend", "mujoco_reach",
        "--num-envs", "4", name="early-worker",
    )  # fmt: skip
    wait_for(lambda: "dialling ZeroMQ" in log_of(worker), what="the worker to dial ZeroMQ")
    run = gateway_run(
        {
            "env": {"backend": "mujoco_reach", "num_envs": 4},
            "policy": {"kind": "random"},
            "gateway": {"worker_port": port},
        }
    )
    wait_for(lambda: run.status()["env_steps"] >= 100, timeout=60, what="100 env steps")
    assert link_of(run) == [True]
    assert "registering again over it" in log_of(worker)
    final = run.drain()
    count = EpisodeStore(run.run_dir / "episodes", readonly=True).count()
    assert count.stored_steps == final["acked_steps"] and count.duplicate_steps == 0
