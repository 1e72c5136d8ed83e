"""Observations as CUDA IPC handles through the data path: worker -> gateway -> inference
server, and every fallback to host arrays.

A real env worker (the torch reach through the Isaac Lab adapter), a real gateway (its
recorder, spool and episode store) and a real inference server (torch backend) talk over
loopback TCP. CUDA cannot run on this machine, so those that share memory run in threads
of this process with ``standin`` (:mod:`tests.cuda_standin`: CPU tensors and a table in
this process stand in for the GPU and its IPC handles); everything else is the
product's code. The last test runs ``loopgate up``'s real processes without CUDA.
Real CUDA: ``tests/test_cuda_ipc_gpu.py``.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zmq

from gateway.config import GatewayConfig
from gateway.control_client import ControlClient
from gateway.cuda_handles import RingOffer
from gateway.factory import experiment_spec, make_backend
from gateway.hub import Gateway
from gateway.protocol import Message, MsgType, pack, recv, send
from gateway.recorder import Recorder
from gateway.store import EpisodeStore, StoreSink
from gateway.worker import EnvWorker
from inference.client import InferenceSource
from inference.config import InferenceConfig
from inference.server import SOCKETS, InferenceServer
from networks.config import NetworkConfig
from tests.conftest import loopgate, time_left, wait_for

OPTIONS = {"device": "cpu", "episode_length": 20, "random_start": True, "threads": 1}
N = 64
STEPS = 40
SPEC = experiment_spec("torch_reach", OPTIONS)


def inference_config(**overrides: Any) -> InferenceConfig:
    base = {
        "enabled": True,
        "backend": "torch",
        "device": "cpu",
        "threads": 1,
        "max_wait_us": 0,
        "max_batch": N,
        "network": NetworkConfig(hidden_sizes=(32, 32)),
    }
    return InferenceConfig(**{**base, **overrides})


def tcp(names: Any) -> dict[str, str]:
    return {name: "tcp://127.0.0.1:0" for name in names}


class Loop:
    """An inference server, a gateway and a torch reach worker, each on its own thread."""

    def __init__(
        self, tmp: Path, *, gateway: str = "auto", server: str = "auto", worker: str = "auto"
    ) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.server = InferenceServer(
            config=inference_config(cuda_ipc=server), spec=SPEC, addresses=tcp(SOCKETS), context=self.ctx
        )
        source = InferenceSource([self.server.addresses], heartbeat_s=0.05, context=self.ctx)
        recorder = Recorder(tmp / "spool", StoreSink(EpisodeStore(tmp / "episodes")))
        recorder.recover()
        self.store = tmp / "episodes"
        self.gateway = Gateway(
            config=GatewayConfig(cuda_ipc=gateway),  # type: ignore[arg-type]
            source=source,
            recorder=recorder,
            spec=SPEC,
            addresses=tcp(("workers", "clients", "control")),
            context=self.ctx,
        )
        backend = make_backend("torch_reach", num_envs=N, seed=0, options=OPTIONS)
        self.worker = EnvWorker(
            backend, self.gateway.addresses["workers"], context=self.ctx, cuda_ipc=worker, heartbeat_s=0.5
        )
        self.control = ControlClient(self.gateway.addresses["control"])

    def _thread(self, target: Any, **kwargs: Any) -> None:
        thread = threading.Thread(target=target, kwargs=kwargs, daemon=True)
        thread.start()
        self.threads.append(thread)

    def status(self) -> dict[str, Any]:
        return self.control.request("status", timeout_s=5.0)

    def run(self, steps: int = STEPS) -> tuple[dict[str, Any], dict[str, Any]]:
        """Collect ``steps`` batches: the gateway's status with the worker registered (taken
        while collection is paused: a fast run could otherwise end, and the worker say
        goodbye, between two looks) and once everything is stored."""
        self._thread(self.server.serve, stop=self.stop)
        self._thread(self.gateway.run, stop=self.stop)
        wait_for(lambda: self.gateway.source.replicas[0].up, timeout=time_left(), what="the server up")
        self.control.request("pause", timeout_s=5.0)
        worker = threading.Thread(target=self.worker.run, kwargs={"max_steps": steps * N}, daemon=True)
        worker.start()
        joined = wait_for(
            lambda: (s := self.status())["workers"] and s, timeout=time_left(), what="the worker registered"
        )
        self.control.request("resume", timeout_s=5.0)
        worker.join(timeout=time_left())
        assert not worker.is_alive(), "the worker did not finish its steps"
        self.control.request("pause", timeout_s=5.0)
        status = self.status()
        assert self.control.request("drain", timeout_s=20.0)["drained"]
        return joined, status

    def stored_steps(self) -> int:
        count = EpisodeStore(self.store, readonly=True).count()
        assert count.duplicate_steps == 0
        return int(count.stored_steps)

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=10)
        self.control.close()
        self.gateway.close()
        self.server.close()
        self.ctx.destroy(linger=0)


@pytest.fixture
def loop(tmp_path: Path):
    made: list[Loop] = []

    def make(**modes: str) -> Loop:
        made.append(Loop(tmp_path / f"loop-{len(made)}", **modes))
        return made[-1]

    try:
        yield make
    finally:
        for one in made:
            one.close()


def served(loop: Loop) -> dict[str, Any]:
    return loop.server.stats.snapshot()


def served_all(loop: Loop, settled: Any = lambda s: True) -> dict[str, Any]:
    """The server's stats once they count every batch: the server counts a batch after its
    answers leave, so the worker can finish (and the test read them) a moment before."""
    return wait_for(
        lambda: (s := served(loop))["requests"] >= STEPS and settled(s) and s,
        timeout=time_left(),
        what=f"the server to count {STEPS} requests",
    )


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_observations_reach_a_same_gpu_server_as_handles_and_every_step_is_stored(loop, standin):
    run = loop()
    half, status = run.run()
    (worker,) = half["workers"]
    assert worker["cuda_ipc"] and half["policy"]["replicas"][0]["cuda_ipc"]
    # Every request the server answered came as a handle (none fell back to arrays).
    stats = served_all(run, lambda s: s["requests"] == s.get("device_requests"))
    assert status["policy"]["device_requests"] == status["policy"]["submitted"]
    assert stats["device_bytes"] == stats["device_requests"] * N * 15 * 4
    # The gateway still got the host arrays and recorded every step from them.
    assert run.stored_steps() == status["acked_steps"] >= (STEPS - 1) * N


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("modes", "why"),
    [
        ({"gateway": "off"}, "the gateway declines the ring"),
        ({"server": "off"}, "the server declares no GPU"),
        ({"worker": "off"}, "the worker offers nothing"),
    ],
)
def test_when_any_side_says_no_inference_gets_host_arrays_and_the_run_collects(loop, standin, modes, why):
    run = loop(**modes)
    half, status = run.run()
    (worker,) = half["workers"]
    assert worker["cuda_ipc"] is (modes == {"server": "off"}), why
    assert served_all(run).get("device_requests", 0) == 0 and status["policy"]["device_requests"] == 0
    assert run.stored_steps() == status["acked_steps"] >= (STEPS - 1) * N


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_server_that_cannot_open_the_handles_gets_host_arrays_and_no_step_is_lost(
    loop, standin, monkeypatch
):
    def gone(index: int, storage: list[Any]) -> Any:
        raise RuntimeError("CUDA error: invalid device context (stand-in)")

    monkeypatch.setattr(standin, "open", gone)
    run = loop()
    _, status = run.run()
    stats = served(run)
    assert stats["errors"].get("bad_request", 0) >= 1 and stats.get("device_requests", 0) == 0
    assert not status["policy"]["replicas"][0]["cuda_ipc"]  # no more handles to it
    assert status["policy"]["failed"] == 0
    assert run.stored_steps() == status["acked_steps"] >= (STEPS - 1) * N


class ServerOnly:
    def __init__(self, **config: Any) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.stop = threading.Event()
        self.server = InferenceServer(
            config=inference_config(**config), spec=SPEC, addresses=tcp(SOCKETS), context=self.ctx
        )
        self.thread = threading.Thread(target=self.server.serve, kwargs={"stop": self.stop}, daemon=True)
        self.thread.start()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(self.server.addresses["requests"])

    def ask(self, msg: Message) -> Message:
        send(self.sock, msg)
        assert self.sock.poll(10_000), "no answer"
        return recv(self.sock)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        self.server.close()
        self.ctx.destroy(linger=0)


@pytest.fixture
def server_only():
    made: list[ServerOnly] = []

    def make(**config: Any) -> ServerOnly:
        made.append(ServerOnly(**config))
        return made[-1]

    try:
        yield make
    finally:
        for one in made:
            one.close()


def device_request(seq: int, obs: dict[str, torch.Tensor], ring: Any, **meta: Any) -> Message:
    handle = RingOffer.parse(ring.offer()).handle(ring.write(seq, obs))
    return Message(MsgType.INFER, seq=seq, meta={"deadline_ms": 5000, "cuda_ipc": handle, **meta})


@pytest.mark.integration
def test_the_server_answers_a_handle_exactly_as_the_same_arrays_and_refuses_bad_ones(server_only, standin):
    from gateway.cuda_ipc import CudaRing

    server = server_only()
    ring = CudaRing.create({"policy": ("float32", (N, 15))}, "cpu")
    obs = {"policy": torch.randn(N, 15, generator=torch.Generator().manual_seed(3))}
    arrays = pack("obs", {"policy": obs["policy"].numpy()})
    host = server.ask(Message(MsgType.INFER, seq=1, meta={"deadline_ms": 5000}, arrays=arrays))
    device = server.ask(device_request(2, obs, ring))
    assert host.type is device.type is MsgType.ACTION
    np.testing.assert_array_equal(device.arrays["action"], host.arrays["action"])
    heartbeat = server.ask(Message(MsgType.HEARTBEAT, seq=3))
    assert heartbeat.meta["cuda_ipc"]["uuid"] == ring.uuid  # how gateways learn it takes handles

    both = device_request(4, obs, ring)
    both.arrays.update(pack("obs", {"policy": obs["policy"].numpy()}))
    wrong = CudaRing.create({"policy": ("float32", (N, 14))}, "cpu")
    narrow = device_request(5, {"policy": torch.zeros(N, 14)}, wrong)
    garbled = Message(MsgType.INFER, seq=6, meta={"cuda_ipc": {"v": 1}})
    for msg, problem in [
        (both, "obs/* arrays or a CUDA IPC handle, not both"),
        (narrow, "observation 'policy' is float32[64, 14], expected float32[64, 15]"),
        (garbled, "CUDA IPC handle: host and uuid must be strings"),
    ]:
        answer = server.ask(msg)
        assert answer.type is MsgType.ERROR and answer.meta["code"] == "bad_request"
        assert problem in answer.meta["message"]
    assert server.ask(device_request(7, obs, ring)).type is MsgType.ACTION  # and it goes on serving


@pytest.mark.integration
def test_a_server_without_cuda_ipc_refuses_handles_saying_what_to_send(server_only, standin):
    from gateway.cuda_ipc import CudaRing

    server = server_only(cuda_ipc="off")
    ring = CudaRing.create({"policy": ("float32", (N, 15))}, "cpu")
    answer = server.ask(device_request(1, {"policy": torch.zeros(N, 15)}, ring))
    assert answer.type is MsgType.ERROR and "send obs/* arrays" in answer.meta["message"]
    assert "cuda_ipc" not in server.ask(Message(MsgType.HEARTBEAT, seq=2)).meta


@pytest.mark.e2e
@pytest.mark.timeout(240)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback of a machine without CUDA")
def test_without_a_gpu_a_run_asked_for_cuda_ipc_says_why_once_and_collects_with_frames(tmp_path):
    """Real processes (``loopgate up``) and the real CUDA checks: this machine has no GPU."""
    run = tmp_path / "run"
    out = loopgate(
        "up", "configs/collect_pd.yaml", "--run-dir", str(run), "--max-env-steps", "3000",
        "--set", "env.backend=torch_reach", "--set", "env.workers=1", "--set", "env.num_envs=64", "--set", "env.options={device: cpu}",
        "--set", "policy.kind=inference", "--set", "inference.enabled=true", "--set", "inference.backend=torch",
        "--set", "inference.device=cpu", "--set", "inference.network.hidden_sizes=[32,32]",
        "--set", "gateway.cuda_ipc='on'",
        timeout=220,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["outcome"] == "completed" and summary["lost_steps"] == 0
    assert summary["stored_steps"] == summary["acked_steps"] >= 3000
    worker_log = (run / "logs" / "worker-0.log").read_text()  # one worker: a second one could be
    # stopped by the spent budget while still importing torch, before it logs anything
    assert worker_log.count("no CUDA IPC ring") == 1 and "sees no CUDA device" in worker_log
    assert summary["inference"]["inference-0"].get("device_requests", 0) == 0
