"""Every socket of every service survives garbage: the gateway, the inference server and
the replay service, each a real process on loopback (one per service for this module).

Good peers do the service's real work between the garbage: a worker registered with
HELLO gets ACTIONs that fit the spec for its observations, a client attaches to a
worker, an inference request gets actions, the replay ingest acknowledges chunks; on
control sockets a status request gets the status.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from gateway import steps
from gateway.factory import experiment_spec
from gateway.protocol import Message, MsgType, pack, recv, send
from gateway.store import EpisodeStore
from tests.conformance.socket_service import ServiceUnderTest, SocketServiceConformance, fresh_ids
from tests.conformance.trajectory_sink import episode_chunks
from tests.conftest import GatewayRun, Procs, time_left, wait_for, write_config
from tests.test_action_source_conformance import InferenceServer
from tests.test_replay_service import Service, running_service
from trainer.replay.ingest import INGEST_LIMITS

SPEC = experiment_spec("mujoco_reach", {})


def answer(sock: zmq.Socket[Any], what: str) -> Message:
    assert sock.poll(int(min(10.0, time_left()) * 1000)), f"no answer to {what}"
    return recv(sock)


def assert_actions(msg: Message, rows: int, seq: int) -> None:
    assert msg.type is MsgType.ACTION, f"{msg.type.name}: {msg.meta}"
    assert msg.seq == seq
    action = msg.arrays["action"]
    assert action.shape == (rows, *SPEC.action.shape) and action.dtype == np.dtype(SPEC.action.dtype)
    assert np.all(action >= SPEC.action.low_array) and np.all(action <= SPEC.action.high_array)


def command(sock: zmq.Socket[Any], seq: int, **meta: Any) -> Message:
    send(sock, Message(MsgType.COMMAND, seq=seq, meta=meta))
    reply = answer(sock, f"command {meta}")
    assert reply.type is MsgType.REPLY and reply.seq == seq, reply.meta
    return reply


def counting_exchange(do: Any) -> Any:
    """An exchange numbered by its own seq counter."""
    seqs = iter(range(1, 1 << 30))
    return lambda: do(next(seqs))


# ----------------------------------------------------------------- the gateway


class Gateway:
    """A gateway process with one real worker streaming, and raw peers for its sockets."""

    def __init__(self, procs: Procs, tmp: Path) -> None:
        config = {
            "env": {"backend": "mujoco_reach", "num_envs": 2},
            "policy": {"kind": "random"},
            "gateway": {"worker_timeout_s": 60.0},
        }
        self.run = GatewayRun(procs, tmp / "run", write_config(tmp / "config.yaml", **config)).start()
        self.worker = self.run.worker(0)
        wait_for(lambda: self.run.status()["env_steps"] >= 20, what="the real worker streaming")
        self.uids = fresh_ids("raw-worker")
        self.socks: list[zmq.Socket[Any]] = []

    def alive(self) -> bool:
        assert self.run.proc is not None
        return self.run.proc.poll() is None

    def errors(self) -> int:
        return sum(self.run.status()["errors"].values())

    def register_worker(self, sock: zmq.Socket[Any]) -> str:
        uid = self.uids()
        send(sock, Message(MsgType.HELLO, seq=1, meta={"uid": uid, "num_envs": 1, "spec": SPEC.to_dict()}))
        welcome = answer(sock, "HELLO")
        assert welcome.type is MsgType.WELCOME and welcome.meta["uid"] == uid, welcome.meta
        return uid

    def worker_peer(self, sock: zmq.Socket[Any]) -> Any:
        uid = self.register_worker(sock)
        seqs = iter(range(2, 1 << 30))

        def observe() -> None:
            seq = next(seqs)
            info = steps.pack(
                episode=0, step=0, t_capture=time.time(), has_prev=0, reward=0.0,
                terminated=0, truncated=0, success=0,
            )  # fmt: skip
            arrays = {**pack("obs", SPEC.zeros(1)), "step_info": info}
            send(sock, Message(MsgType.OBSERVATION, seq=seq, meta={"uid": uid, "reset": True}, arrays=arrays))
            assert_actions(answer(sock, "an observation"), 1, seq)

        return observe

    def client_peer(self, sock: zmq.Socket[Any]) -> Any:
        spare = zmq.Context.instance().socket(zmq.DEALER)
        spare.linger = 0
        spare.connect(self.run.endpoints["workers"])
        self.socks.append(spare)
        uid = self.register_worker(spare)
        send(sock, Message(MsgType.HELLO, seq=1, meta={"num_envs": 1, "worker": uid, "takeover": True}))
        welcome = answer(sock, "a client HELLO")
        assert welcome.type is MsgType.WELCOME, welcome.meta

        def heartbeat(seq: int) -> None:
            send(sock, Message(MsgType.HEARTBEAT, seq=seq))
            reply = answer(sock, "a client HEARTBEAT")
            assert reply.type is MsgType.HEARTBEAT and reply.seq == seq, reply.meta

        return counting_exchange(heartbeat)

    def control_peer(self, sock: zmq.Socket[Any]) -> Any:
        def status(seq: int) -> None:
            reply = command(sock, seq, cmd="status")
            assert isinstance(reply.meta["env_steps"], int) and reply.meta["workers"]

        return counting_exchange(status)

    def close(self) -> None:
        for sock in self.socks:
            sock.close(linger=0)
        self.run.close()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("gateway-garbage")
    procs = Procs(tmp)
    try:
        gw = Gateway(procs, tmp)
        yield gw
        gw.close()
    finally:
        procs.kill_all()


class TestGatewayWorkerSocketSurvivesGarbage(SocketServiceConformance):
    @pytest.fixture
    def service_under_test(self, gateway: Gateway) -> ServiceUnderTest:
        return ServiceUnderTest(
            address=gateway.run.endpoints["workers"],
            good_peer=gateway.worker_peer,
            alive=gateway.alive,
            unaccepted=(MsgType.OBSERVATION, "not_registered"),
            errors_counted=gateway.errors,
        )

    def test_a_hello_with_a_malformed_spec_is_refused_naming_the_spec(self, gateway, dealer) -> None:
        sock = dealer(gateway.run.endpoints["workers"])
        send(sock, Message(MsgType.HELLO, seq=3, meta={"uid": "x", "num_envs": 1, "spec": {"name": "reach"}}))
        reply = answer(sock, "a HELLO with a bad spec")
        assert reply.meta["code"] == "bad_request" and "spec" in reply.meta["message"] and reply.seq == 3

    def test_the_streaming_worker_keeps_stepping_through_a_flood(
        self, gateway, dealer, service_under_test
    ) -> None:
        before = gateway.run.status()["env_steps"]
        self.test_a_flood_from_one_bad_peer_leaves_a_good_peer_correctly_served(service_under_test, dealer)
        wait_for(
            lambda: gateway.run.status()["env_steps"] >= before + 100, what="the real worker to keep stepping"
        )
        assert gateway.worker.poll() is None
        count = EpisodeStore(gateway.run.run_dir / "episodes", readonly=True).count()
        assert count.duplicate_steps == 0


class TestGatewayClientSocketSurvivesGarbage(SocketServiceConformance):
    @pytest.fixture
    def service_under_test(self, gateway: Gateway) -> ServiceUnderTest:
        return ServiceUnderTest(
            address=gateway.run.endpoints["clients"],
            good_peer=gateway.client_peer,
            alive=gateway.alive,
            unaccepted=(MsgType.STEP, "not_registered"),
            errors_counted=gateway.errors,
        )


class TestGatewayControlSocketSurvivesGarbage(SocketServiceConformance):
    @pytest.fixture
    def service_under_test(self, gateway: Gateway) -> ServiceUnderTest:
        return ServiceUnderTest(
            address=gateway.run.endpoints["control"],
            good_peer=gateway.control_peer,
            alive=gateway.alive,
            unaccepted=(MsgType.BATCH, "unexpected"),
            errors_counted=gateway.errors,
        )


# ------------------------------------------------------------ the inference server


@pytest.fixture(scope="module")
def inference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferenceServer]:
    tmp = tmp_path_factory.mktemp("inference-garbage")
    procs = Procs(tmp)
    try:
        yield InferenceServer(procs, tmp / "run")
    finally:
        procs.kill_all()


def inference_metadata(server: InferenceServer, sock: zmq.Socket[Any], seq: int) -> dict[str, Any]:
    send(sock, Message(MsgType.METADATA, seq=seq))
    reply = answer(sock, "METADATA")
    assert reply.type is MsgType.REPLY and reply.seq == seq, reply.meta
    assert reply.meta["spec"] == SPEC.to_dict() and isinstance(reply.meta["version"], int)
    return reply.meta


class InferenceSocket(SocketServiceConformance):
    socket: str

    @pytest.fixture
    def service_under_test(self, inference: InferenceServer) -> Iterator[ServiceUnderTest]:
        control = zmq.Context.instance().socket(zmq.DEALER)
        control.linger = 0
        control.connect(inference.addresses["control"])
        seqs = iter(range(1, 1 << 30))

        def errors() -> int:
            return sum(inference_metadata(inference, control, next(seqs))["stats"]["errors"].values())

        try:
            yield ServiceUnderTest(
                address=inference.addresses[self.socket],
                good_peer=lambda sock: self.good_peer(inference, sock),
                alive=lambda: inference.proc.poll() is None,
                unaccepted=(MsgType.BATCH, "unexpected"),
                errors_counted=errors,
            )
        finally:
            control.close(linger=0)

    def good_peer(self, server: InferenceServer, sock: zmq.Socket[Any]) -> Any:
        return counting_exchange(lambda seq: inference_metadata(server, sock, seq))


class TestInferenceRequestSocketSurvivesGarbage(InferenceSocket):
    socket = "requests"

    def good_peer(self, server: InferenceServer, sock: zmq.Socket[Any]) -> Any:
        rng = np.random.default_rng(0)

        def infer(seq: int) -> None:
            obs = {k: rng.standard_normal((3, *a.shape)).astype(a.dtype) for k, a in SPEC.observation.items()}
            send(sock, Message(MsgType.INFER, seq=seq, meta={"deadline_ms": 10_000}, arrays=pack("obs", obs)))
            assert_actions(answer(sock, "an inference request"), 3, seq)

        return counting_exchange(infer)


class TestInferenceWeightsSocketSurvivesGarbage(InferenceSocket):
    socket = "weights"


class TestInferenceControlSocketSurvivesGarbage(InferenceSocket):
    socket = "control"


# -------------------------------------------------------------- the replay service


@pytest.fixture(scope="module")
def replay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with running_service(tmp_path_factory.mktemp("replay-garbage")) as svc:
        yield svc


def replay_alive(svc: Service) -> bool:
    assert svc.proc is not None
    return svc.proc.poll() is None


class TestReplayIngestSocketSurvivesGarbage(SocketServiceConformance):
    @pytest.fixture
    def service_under_test(self, replay: Service) -> ServiceUnderTest:
        episodes = fresh_ids("garbage-ep")

        def good_peer(sock: zmq.Socket[Any]) -> Any:
            def ingest(seq: int) -> None:
                chunk = episode_chunks(episodes(), 4, 4)[0]
                chunk.seq = seq
                send(sock, chunk)
                ack = answer(sock, "a chunk")
                assert ack.type is MsgType.CHUNK_ACK and ack.meta["ids"] == [chunk.meta["chunk_id"]], ack.meta

            return counting_exchange(ingest)

        return ServiceUnderTest(
            address=replay.endpoints["ingest"],
            good_peer=good_peer,
            alive=lambda: replay_alive(replay),
            unaccepted=(MsgType.BATCH, "bad_request"),
            errors_counted=lambda: int(replay.status()["ingest"]["malformed"]),
            limits=INGEST_LIMITS,
        )


class ReplaySocket(SocketServiceConformance):
    socket: str

    @pytest.fixture
    def service_under_test(self, replay: Service) -> ServiceUnderTest:
        def good_peer(sock: zmq.Socket[Any]) -> Any:
            def status(seq: int) -> None:
                assert "online" in command(sock, seq, cmd="status").meta["tables"]

            return counting_exchange(status)

        return ServiceUnderTest(
            address=replay.endpoints[self.socket],
            good_peer=good_peer,
            alive=lambda: replay_alive(replay),
            unaccepted=(MsgType.BATCH, "unexpected"),
            errors_counted=lambda: sum(replay.status()["errors"].values()),
        )


class TestReplaySampleSocketSurvivesGarbage(ReplaySocket):
    socket = "sample"


class TestReplayControlSocketSurvivesGarbage(ReplaySocket):
    socket = "control"
