"""Inference server processes over real ZeroMQ: batching, deadlines, bad input, weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
import zmq

from gateway.factory import experiment_spec
from gateway.protocol import Message, MsgType, RemoteError, pack, recv, send
from inference.weights import WeightsPublisher, transfer_messages
from networks.modules import NetworkConfig, export_onnx, make_actor, state_dict_numpy
from tests.conftest import REPO, wait_for

pytestmark = pytest.mark.integration

NET = {"hidden_sizes": [32, 32]}
SPEC = experiment_spec("mujoco_reach", {})


class Server:
    """One ``python -m inference`` process on a fresh run folder."""

    def __init__(self, tmp: Path, backend: str, env: dict[str, str] | None = None, **inference: Any) -> None:
        self.run_dir = tmp / f"run-{backend}"
        self.run_dir.mkdir(parents=True)
        config = {
            "env": {"backend": "mujoco_reach"},
            "inference": {"backend": backend, "network": NET, **inference},
        }
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(config))
        (self.run_dir / "spec.json").write_text(json.dumps(SPEC.to_dict()))
        self.log = self.run_dir / "server.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "inference", "--config", str(self.run_dir / "config.yaml"),
                 "--run-dir", str(self.run_dir), "--log-level", "INFO"],
                stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )  # fmt: skip
        endpoints = self.run_dir / "endpoints.json"
        wait_for(
            lambda: endpoints.exists() and json.loads(endpoints.read_text()).get("inference"),
            60,
            what="server up",
        )
        self.addresses: dict[str, str] = json.loads(endpoints.read_text())["inference"][0]
        self.socks: list[zmq.Socket[Any]] = []

    def dealer(self, name: str = "requests") -> zmq.Socket[Any]:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(self.addresses[name])
        self.socks.append(sock)
        return sock

    def ask(self, sock: zmq.Socket[Any], msg: Message, timeout_s: float = 10.0) -> Message:
        send(sock, msg)
        assert sock.poll(int(timeout_s * 1000)), f"no answer to {msg.type.name}; log:\n{self.log.read_text()}"
        return recv(sock)

    def metadata(self) -> dict[str, Any]:
        return self.ask(self.dealer("control"), Message(MsgType.METADATA)).meta

    def close(self) -> None:
        for sock in self.socks:
            sock.close(linger=0)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(tmp_path_factory.mktemp("inference"), "onnxruntime", max_wait_us=20_000)
    try:
        yield s
    finally:
        s.close()


def obs_request(n: int, seq: int = 1, **meta: Any) -> Message:
    rng = np.random.default_rng(seq)
    obs = {k: rng.standard_normal((n, *a.shape)).astype(a.dtype) for k, a in SPEC.observation.items()}
    return Message(MsgType.INFER, seq=seq, meta={"deadline_ms": 5000, **meta}, arrays=pack("obs", obs))


def test_metadata_describes_spec_backend_device_version_and_queue(server):
    meta = server.metadata()
    assert meta["spec"] == SPEC.to_dict()
    assert meta["backend"] == "onnxruntime" and meta["device"] == "cpu"
    assert meta["providers"] == ["CPUExecutionProvider"]
    assert meta["queue_rows"] == 0 and isinstance(meta["version"], int)
    assert meta["max_wait_us"] == 20_000  # as configured
    assert meta["network"]["hidden_sizes"] == [32, 32]


def test_requests_from_many_clients_are_batched_together(server):
    clients = [server.dealer() for _ in range(4)]
    for i, sock in enumerate(clients):  # the server learns who its clients are
        assert server.ask(sock, obs_request(1, seq=90 + i)).type is MsgType.ACTION
    for i, sock in enumerate(clients):
        send(sock, obs_request(3, seq=100 + i))
    answers = []
    for i, sock in enumerate(clients):
        assert sock.poll(10_000)
        reply = recv(sock)
        assert reply.type is MsgType.ACTION and reply.seq == 100 + i
        assert reply.arrays["action"].shape == (3, 3) and reply.arrays["policy_version"].shape == (3,)
        answers.append(reply.meta["batch_rows"])
    assert max(answers) > 3  # the server waited for its known clients: they shared a forward pass


def test_a_sub_millisecond_wait_for_company_ends_in_an_answer(tmp_path):
    """``max_wait_us`` under a millisecond is waited to the microsecond (``zmq.poll`` would
    round it up to a whole one): with two known clients and only one asking, the batch
    leaves without its company and is answered; asked together, both are answered."""
    s = Server(tmp_path, "onnxruntime", max_wait_us=300)
    try:
        assert s.metadata()["max_wait_us"] == 300
        a, b = s.dealer(), s.dealer()
        for i, sock in enumerate((a, b)):  # the server learns that two clients ask
            assert s.ask(sock, obs_request(1, seq=10 + i)).type is MsgType.ACTION
        for seq in range(20, 30):
            reply = s.ask(a, obs_request(2, seq=seq))
            assert reply.type is MsgType.ACTION and reply.seq == seq and reply.meta["batch_rows"] == 2
        send(a, obs_request(1, seq=40))
        send(b, obs_request(1, seq=41))
        for sock, seq in ((a, 40), (b, 41)):
            assert sock.poll(10_000), s.log.read_text()
            reply = recv(sock)
            assert reply.type is MsgType.ACTION and reply.seq == seq
    finally:
        s.close()


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda a: a.pop("obs/joint_pos"), "'joint_pos' is missing"),
        (lambda a: a.update({"obs/joint_vel": a["obs/joint_vel"].astype(np.float64)}), "float64"),
        (lambda a: a.update({"obs/ee_pos": np.zeros((2, 5), np.float32)}), "expected float32[2, 2]"),
        (lambda a: a.update({"obs/extra": np.zeros((2, 1), np.float32)}), "unexpected observation keys"),
    ],
)
def test_observations_that_do_not_fit_the_spec_are_refused_and_serving_goes_on(server, change, problem):
    sock = server.dealer()
    bad = obs_request(2, seq=7)
    change(bad.arrays)
    reply = server.ask(sock, bad)
    assert reply.type is MsgType.ERROR and reply.meta["code"] == "bad_request"
    assert problem in reply.meta["message"] and reply.seq == 7
    assert server.ask(sock, obs_request(2, seq=8)).type is MsgType.ACTION


def test_a_request_whose_actions_are_not_finite_is_refused_and_its_batch_mates_are_served(server):
    good, poisoned = server.dealer(), server.dealer()
    for i, sock in enumerate((good, poisoned)):  # the server learns who its clients are
        assert server.ask(sock, obs_request(1, seq=60 + i)).type is MsgType.ACTION
    bad = obs_request(3, seq=63)
    bad.arrays["obs/joint_pos"] = bad.arrays["obs/joint_pos"].copy()
    bad.arrays["obs/joint_pos"][1] = np.nan  # one row of three
    send(good, obs_request(2, seq=62))
    send(poisoned, bad)
    assert good.poll(10_000) and poisoned.poll(10_000)
    served, refused = recv(good), recv(poisoned)
    assert served.type is MsgType.ACTION and served.seq == 62 and np.isfinite(served.arrays["action"]).all()
    assert refused.type is MsgType.ERROR and refused.seq == 63
    assert refused.meta["code"] == "bad_request" and "non-finite" in refused.meta["message"]
    assert server.ask(poisoned, obs_request(2, seq=64)).type is MsgType.ACTION


def test_a_request_past_its_deadline_gets_a_typed_error_not_a_late_action(server):
    reply = server.ask(server.dealer(), obs_request(2, seq=9, deadline_ms=0.001))
    assert reply.type is MsgType.ERROR and reply.meta["code"] == "deadline_exceeded"


def test_evaluation_rows_get_the_deterministic_action_while_others_sample(server):
    sock = server.dealer()
    flags = np.array([True, False, True, False])
    answers = []
    for seq in (30, 31):
        msg = obs_request(4, seq=1, deterministic=False)  # same observations, stochastic mode
        msg.seq = seq
        msg.arrays["deterministic"] = flags
        answers.append(server.ask(sock, msg).arrays["action"])
    np.testing.assert_array_equal(answers[0][flags], answers[1][flags])
    assert not np.allclose(answers[0][~flags], answers[1][~flags])
    bad = obs_request(4, seq=32)
    bad.arrays["deterministic"] = np.ones(3, bool)
    assert server.ask(sock, bad).meta["code"] == "bad_request"


def test_a_client_that_vanishes_before_its_answers_does_not_disturb_others(server):
    # Garbage on every socket: tests/test_socket_services.py.
    rude = server.dealer()
    for i in range(50):  # send and disappear before any answer
        send(rude, obs_request(8, seq=1000 + i))
    rude.close(linger=0)
    server.socks.remove(rude)
    sock = server.dealer()
    for i in range(5):
        assert server.ask(sock, obs_request(4, seq=i + 1)).type is MsgType.ACTION
    assert server.proc.poll() is None


def publisher(server: Server, **kw: Any) -> WeightsPublisher:
    return WeightsPublisher([server.addresses], timeout_s=20.0, **kw)


def test_weights_hot_swap_refusals_and_rollback(server):
    sock = server.dealer()
    pub = publisher(server, bucket_bytes=4096)  # several buckets, some tensors split
    try:
        before = server.metadata()["version"]
        actor = make_actor(SPEC, NetworkConfig(hidden_sizes=(32, 32)), seed=11)
        new = before + 1
        [ack] = pub.publish(state_dict_numpy(actor), new)
        assert ack["ok"] and ack["version"] == new and ack["previous"] == before
        reply = server.ask(sock, obs_request(3, seq=20))
        assert list(reply.arrays["policy_version"]) == [new] * 3

        bad = state_dict_numpy(actor)
        bad["trunk.0.weight"] = bad["trunk.0.weight"].copy()
        bad["trunk.0.weight"][0, 0] = np.nan
        with pytest.raises(RemoteError) as nan:
            pub.publish(bad, new + 1)
        assert nan.value.code == "bad_weights" and "NaN" in nan.value.message
        with pytest.raises(RemoteError) as stale:
            pub.publish(state_dict_numpy(actor), new)
        assert stale.value.code == "stale_version"
        blob = export_onnx(actor)
        with pytest.raises(RemoteError) as truncated:
            pub.publish_onnx(blob[: len(blob) // 2], new + 1)
        assert truncated.value.code == "bad_weights"

        # A transfer that loses a bucket on the way is refused once its last one arrives.
        raw = server.dealer("weights")
        messages = transfer_messages(state_dict_numpy(actor), new + 1, "state_dict", 4096)
        for msg in messages[:1] + messages[2:]:
            send(raw, msg)
        assert raw.poll(10_000)
        answer = recv(raw)
        assert answer.type is MsgType.ERROR and answer.meta["code"] == "bad_weights"

        assert server.ask(sock, obs_request(3, seq=21)).arrays["policy_version"][0] == new
        [ack] = pub.publish_onnx(blob, new + 2)
        assert ack["version"] == new + 2
        [back] = pub.rollback()
        assert back["version"] == new and back["rolled_back_from"] == new + 2
        assert server.ask(sock, obs_request(3, seq=22)).arrays["policy_version"][0] == new
    finally:
        pub.close()


def test_a_server_killed_with_sigkill_leaves_no_graph_files_behind(tmp_path):
    """onnxruntime loads graphs from files; a server that dies however it dies (here
    SIGKILL, no clean-up of its own) must not leave one per run in the temp folder."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    s = Server(tmp_path, "onnxruntime", env={"TMPDIR": str(tmp)})
    pub = publisher(s)
    try:
        actor = make_actor(SPEC, NetworkConfig(**NET), seed=3)
        pub.publish_onnx(export_onnx(actor), 5)  # a graph of its own
        pub.publish(state_dict_numpy(actor), 6)  # into that graph
        assert s.ask(s.dealer(), obs_request(2, seq=30)).arrays["policy_version"][0] == 6
    finally:
        pub.close()
        s.close()  # SIGKILL
    assert s.proc.returncode == -signal.SIGKILL
    # (onnxruntime keeps a small session-id file of its own there, reused by every run.)
    assert [p.name for p in tmp.iterdir() if p.name != ".ses"] == []


def test_serving_goes_on_while_versions_are_swapped(server):
    """Requests stream while three versions are published: every one gets actions."""
    sock = server.dealer()
    pub = publisher(server)
    actor = make_actor(SPEC, NetworkConfig(hidden_sizes=(32, 32)), seed=5)
    try:
        start = server.metadata()["version"] + 1
        versions, seq = [], 0
        for version in range(start, start + 3):
            for _ in range(5):
                seq += 1
                reply = server.ask(sock, obs_request(4, seq=seq))
                assert reply.type is MsgType.ACTION, reply.meta
                versions.append(int(reply.arrays["policy_version"][0]))
            pub.publish(state_dict_numpy(actor), version)
        assert versions == sorted(versions) and versions[-1] == start + 1
    finally:
        pub.close()


def test_a_stream_of_publications_is_logged_once_with_a_count_not_once_each(tmp_path):
    """A trainer publishes several times a second: the server's log says which version
    serves once in ``SWAP_LOG_S`` (30 s; the next such line counts the swaps between),
    not once for each publication."""
    s = Server(tmp_path, "onnxruntime")
    pub = publisher(s)
    actor = make_actor(SPEC, NetworkConfig(hidden_sizes=(32, 32)), seed=5)
    try:
        start = s.metadata()["version"] + 1
        for version in range(start, start + 6):
            pub.publish(state_dict_numpy(actor), version)
        assert s.metadata()["version"] == start + 5
    finally:
        pub.close()
        s.close()
    lines = [line for line in s.log.read_text().splitlines() if "now serving version" in line]
    assert len(lines) == 1 and f"now serving version {start} " in lines[0], lines
    assert "swapping it in" not in s.log.read_text()  # each load is a DEBUG line now


def test_metrics_stream_has_counters_histograms_and_version(server):
    from gateway.metrics import Histogram, read_metrics

    assert server.ask(server.dealer(), obs_request(2, seq=40)).type is MsgType.ACTION

    def records() -> list[dict[str, Any]]:
        return [r for r in read_metrics(server.run_dir / "metrics.jsonl") if r.get("requests")]

    last = wait_for(records, 10, what="an inference metrics record")[-1]
    assert last["service"] == "inference-0"
    for key in ("version", "queue_rows", "batches", "rows", "latency_p50_us", "latency_p99_us", "batch_rows"):
        assert key in last, key
    assert 0 < Histogram.from_dict(last["latency_us"]).n <= last["requests"]


def test_the_torch_backend_serves_and_takes_both_weight_formats(tmp_path):
    s = Server(tmp_path, "torch")
    pub = publisher(s)
    try:
        meta = s.metadata()
        assert meta["backend"] == "torch"
        assert meta["max_wait_us"] == 0  # left null, on a CPU: no wait for a batch's company
        actor = make_actor(SPEC, NetworkConfig(hidden_sizes=(32, 32)), seed=2)
        assert pub.publish(state_dict_numpy(actor), 1)[0]["ok"]
        assert pub.publish_onnx(export_onnx(actor), 2)[0]["ok"]
        reply = s.ask(s.dealer(), obs_request(5, seq=3))
        assert reply.type is MsgType.ACTION and reply.arrays["policy_version"][0] == 2
        with pytest.raises(RemoteError, match="bad_weights"):
            pub.publish({"head.bias": np.zeros(6, np.float32)}, 3)
    finally:
        pub.close()
        s.close()


def test_reused_transfer_buffers_never_touch_the_versions_serving(tmp_path):
    """Split tensors are reassembled into buffers recycled from retired versions (the torch
    backend serves straight from them): the version serving and the one before it must
    keep their own weights while later transfers are reassembled, even refused ones."""
    s = Server(tmp_path, "torch")
    pub = publisher(s, bucket_bytes=1024)  # the 32x32 layers travel in slices
    sock = s.dealer()

    def deterministic(seq: int) -> np.ndarray:
        msg = obs_request(4, seq=1)  # the same observations every time
        msg.seq = seq
        msg.arrays["deterministic"] = np.ones(4, bool)
        reply = s.ask(sock, msg)
        assert reply.type is MsgType.ACTION, reply.meta
        return reply.arrays["action"]

    try:
        served = {}
        for version in range(1, 7):
            actor = make_actor(SPEC, NetworkConfig(hidden_sizes=(32, 32)), seed=100 + version)
            assert pub.publish(state_dict_numpy(actor), version)[0]["ok"]
            served[version] = deterministic(10 + version)
        assert not np.allclose(served[5], served[6])
        # Reassembled (into recycled buffers) and then refused for its last tensor.
        bad = state_dict_numpy(make_actor(SPEC, NetworkConfig(hidden_sizes=(32, 32)), seed=999))
        bad["head.bias"][0] = np.nan
        with pytest.raises(RemoteError, match="NaN"):
            pub.publish(bad, 7)
        np.testing.assert_array_equal(deterministic(20), served[6])
        [back] = pub.rollback()
        assert back["version"] == 5
        np.testing.assert_array_equal(deterministic(30), served[5])
        assert s.metadata()["version"] == 5
    finally:
        pub.close()
        s.close()


def test_a_weights_file_that_does_not_fit_stops_the_server_with_a_config_error(tmp_path):
    path = tmp_path / "w.npz"
    np.savez(path, **{"head.bias": np.zeros(6, np.float32)})
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"inference": {"network": NET, "weights": str(path)}}))
    (run / "spec.json").write_text(json.dumps(SPEC.to_dict()))
    done = subprocess.run(
        [sys.executable, "-m", "inference", "--config", str(run / "config.yaml"), "--run-dir", str(run)],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "bad_weights" in done.stderr and "missing" in done.stderr
    assert time.monotonic() > 0
