"""CUDA IPC on a real GPU: handles across processes, the whole data path, weights.

Nothing here stands in for anything: real CUDA memory shared between real processes,
each its own interpreter (as CUDA IPC requires: no fork after CUDA started). Skipped
where torch sees no CUDA device; ``benchmarks/gpu_check.sh`` runs them on a GPU machine::

    python -m pytest -m gpu tests/test_cuda_ipc_gpu.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
import zmq

from gateway.cuda_handles import RingOffer
from gateway.cuda_ipc import DeviceReader
from gateway.factory import experiment_spec
from gateway.protocol import Message, MsgType, pack, recv, recv_routed, send
from inference.weights import WeightsPublisher
from networks.config import NetworkConfig
from networks.modules import make_actor
from tests.conftest import REPO, loopgate, wait_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU (torch.cuda.is_available() is False); benchmarks/gpu_check.sh runs these",
    ),
]

PRODUCER = REPO / "tests" / "scripts" / "cuda_ring_producer.py"
SPEC = experiment_spec("mujoco_reach", {})
NET = {"hidden_sizes": [64, 64]}


def _recv_routed(sock: zmq.Socket[Any]) -> tuple[bytes, Message]:
    route, msg, err = recv_routed(sock)
    assert err is None and msg is not None, err
    return route, msg


@pytest.mark.timeout(180)
def test_a_ring_in_another_process_is_read_in_place_after_its_event_step_after_step():
    rows, steps = 4096, 50
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    producer = subprocess.Popen(
        [sys.executable, str(PRODUCER), f"tcp://127.0.0.1:{port}", str(steps), str(rows)]
    )
    try:
        assert sock.poll(120_000), "no offer from the producer"
        route, hello = _recv_routed(sock)
        offer = RingOffer.parse(hello.meta["cuda_ipc"])
        reader = DeviceReader("cuda:0")
        expected = torch.arange(rows * 15, dtype=torch.float32, device="cuda:0").reshape(rows, 15)
        for seq in range(1, steps + 1):
            assert sock.poll(30_000), f"no observation {seq}"
            _, msg = _recv_routed(sock)
            assert msg.seq == seq
            got = reader.open(reader.check(offer.handle(msg.meta["cuda_ipc"])))["policy"]
            # Read on this process's stream after waiting on the producer's event: the
            # values of this step, never those the slot held before.
            assert torch.equal(got, expected + seq), f"step {seq} read stale or torn data"
            send(sock, Message(MsgType.ACTION, seq=seq), route=[route])
        send(sock, Message(MsgType.BYE), route=[route])
        assert producer.wait(timeout=60) == 0
        assert reader.bytes_read == steps * rows * 15 * 4
        assert len(reader._storages) == 4  # each slot's storage opened once
    finally:
        if producer.poll() is None:
            producer.kill()
        ctx.destroy(linger=0)


def test_a_ring_made_here_is_opened_and_read_by_a_consumer_in_another_process():
    """The other direction: this process produces, a child process consumes."""
    import msgpack

    from gateway.cuda_ipc import CudaRing

    ring = CudaRing.create({"policy": ("float32", (256, 15))}, "cuda:0")
    src = torch.randn(256, 15, device="cuda:0")
    handle = RingOffer.parse(ring.offer()).handle(ring.write(1, {"policy": src}))
    code = "\n".join(
        [
            "import sys, msgpack",
            f"sys.path.insert(0, {str(REPO)!r})",
            "from gateway.cuda_ipc import DeviceReader",
            "r = DeviceReader('cuda:0')",
            "t = r.open(r.check(msgpack.unpackb(sys.stdin.buffer.read())))['policy']",
            "sys.stdout.write(repr(float(t.sum())))",
        ]
    )
    out = subprocess.run(
        [sys.executable, "-c", code], input=msgpack.packb(handle), capture_output=True, timeout=120
    )
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert abs(float(out.stdout) - float(src.sum())) < 1e-2
    ring.close()


@pytest.mark.timeout(360)
def test_a_run_on_one_gpu_sends_observations_as_handles_and_stores_every_step(tmp_path):
    run = tmp_path / "run"
    out = loopgate(
        "up", "configs/collect_pd.yaml", "--run-dir", str(run), "--max-env-steps", str(4096 * 60),
        "--set", "env.backend=torch_reach", "--set", "env.num_envs=4096",
        "--set", "env.options={device: cuda, episode_length: 100, random_start: true}",
        "--set", "policy.kind=inference", "--set", "inference.enabled=true", "--set", "inference.backend=torch",
        "--set", "inference.device=cuda", "--set", "inference.max_batch=4096",
        "--set", "inference.batch_buckets=[4096]", "--set", "inference.network.hidden_sizes=[64,64]",
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["outcome"] == "completed" and summary["lost_steps"] == 0
    assert summary["stored_steps"] == summary["acked_steps"] >= 4096 * 60
    served = summary["inference"]["inference-0"]
    # The first requests may precede the server's first heartbeat; after that, handles.
    assert served["device_requests"] >= served["requests"] - 5 > 0, served


class GpuServer:
    """One ``python -m inference`` process, torch on CUDA."""

    def __init__(self, tmp: Path, name: str, **inference: Any) -> None:
        self.run_dir = tmp / name
        self.run_dir.mkdir(parents=True)
        config = {
            "env": {"backend": "mujoco_reach"},
            "inference": {"backend": "torch", "device": "cuda", "network": NET, **inference},
        }
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(config))
        (self.run_dir / "spec.json").write_text(json.dumps(SPEC.to_dict()))
        with open(self.run_dir / "server.log", "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "inference", "--config", str(self.run_dir / "config.yaml"),
                 "--run-dir", str(self.run_dir)],
                stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
            )  # fmt: skip
        endpoints = self.run_dir / "endpoints.json"
        wait_for(lambda: endpoints.exists() and json.loads(endpoints.read_text()).get("inference"), 120)
        self.addresses: dict[str, str] = json.loads(endpoints.read_text())["inference"][0]

    def actions(self, obs: dict[str, np.ndarray]) -> np.ndarray:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        try:
            sock.connect(self.addresses["requests"])
            send(sock, Message(MsgType.INFER, seq=1, meta={"deadline_ms": 10_000}, arrays=pack("obs", obs)))
            assert sock.poll(30_000), (self.run_dir / "server.log").read_text()[-2000:]
            answer = recv(sock)
            assert answer.type is MsgType.ACTION, answer.meta
            return np.asarray(answer.arrays["action"])
        finally:
            sock.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


@pytest.mark.timeout(300)
def test_weights_published_as_handles_act_exactly_as_the_same_weights_as_host_buckets(tmp_path):
    servers = [GpuServer(tmp_path, "ipc"), GpuServer(tmp_path, "host", cuda_ipc="off")]
    publisher = WeightsPublisher([s.addresses for s in servers], timeout_s=120.0)
    try:
        obs = {
            k: np.random.default_rng(0).standard_normal((64, *a.shape)).astype(a.dtype)
            for k, a in SPEC.observation.items()
        }
        for version in (1, 2, 3):
            actor = make_actor(SPEC, NetworkConfig(hidden_sizes=(64, 64)), seed=version).cuda()
            weights = {k: v.detach().clone() for k, v in actor.state_dict().items()}
            results = publisher.publish(weights, version=version)
            assert publisher.formats == ["cuda_ipc", "state_dict"]
            assert [r["version"] for r in results] == [version, version]
            np.testing.assert_allclose(servers[0].actions(obs), servers[1].actions(obs), atol=1e-6)
        del weights, actor  # the server holds copies: the publisher's tensors may go
        torch.cuda.synchronize()
        np.testing.assert_allclose(servers[0].actions(obs), servers[1].actions(obs), atol=1e-6)
        assert [r["version"] for r in publisher.rollback()] == [2, 2]
    finally:
        publisher.close()
        for server in servers:
            server.close()
