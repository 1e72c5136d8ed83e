"""Weights over CUDA IPC (format ``cuda_ipc``), its checks, and the host buckets it falls back to.

Real inference servers (torch backend) serve in threads of this process behind real
ZeroMQ sockets; the publisher is the product's :class:`~inference.weights.WeightsPublisher`.
CUDA cannot run on this machine, so where device memory is shared ``standin``
(:mod:`tests.cuda_standin`) plays the GPU: CPU tensors and a table in this process stand
in for device memory and its IPC handles. Real CUDA: ``tests/test_cuda_ipc_gpu.py``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import pytest
import torch
import zmq
from torch import nn

from gateway.factory import experiment_spec
from gateway.protocol import ErrorCode, Message, MsgType, RemoteError, pack, recv, send
from inference.config import InferenceConfig
from inference.server import SOCKETS, InferenceServer
from inference.weights import WeightsAssembler, WeightsError, WeightsPublisher, check_state_dict
from networks.config import NetworkConfig
from networks.modules import make_actor
from trainer.publish import full_state_dict, non_finite

pytestmark = pytest.mark.integration

SPEC = experiment_spec("mujoco_reach", {})
NET = NetworkConfig(hidden_sizes=(32, 32))


def state(seed: int) -> dict[str, torch.Tensor]:
    """A state dict of torch tensors (on the stand-in's "GPU": the CPU)."""
    return {k: v.detach().clone() for k, v in make_actor(SPEC, NET, seed=seed).state_dict().items()}


class Servers:
    """Inference servers (torch, CPU) serving in threads; ``ask`` runs one observation batch."""

    def __init__(self, *modes: str) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.stop = threading.Event()
        self.servers, self.threads = [], []
        for mode in modes:
            config = InferenceConfig(backend="torch", device="cpu", threads=1, network=NET, cuda_ipc=mode)  # type: ignore[arg-type]
            server = InferenceServer(
                config=config,
                spec=SPEC,
                addresses={n: "tcp://127.0.0.1:0" for n in SOCKETS},
                context=self.ctx,
            )
            thread = threading.Thread(target=server.serve, kwargs={"stop": self.stop}, daemon=True)
            thread.start()
            self.servers.append(server)
            self.threads.append(thread)
        self.obs = {
            k: np.random.default_rng(0).standard_normal((8, *a.shape)).astype(a.dtype)
            for k, a in SPEC.observation.items()
        }

    @property
    def targets(self) -> list[dict[str, str]]:
        return [s.addresses for s in self.servers]

    def actions(self, i: int) -> np.ndarray:
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        try:
            sock.connect(self.servers[i].addresses["requests"])
            send(
                sock, Message(MsgType.INFER, seq=1, meta={"deadline_ms": 5000}, arrays=pack("obs", self.obs))
            )
            assert sock.poll(10_000)
            answer = recv(sock)
            assert answer.type is MsgType.ACTION, answer.meta
            return np.asarray(answer.arrays["action"])
        finally:
            sock.close()

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=10)
        for server in self.servers:
            server.close()
        self.ctx.destroy(linger=0)


@pytest.fixture
def servers():
    made: list[Servers] = []

    def make(*modes: str) -> Servers:
        made.append(Servers(*modes))
        return made[-1]

    try:
        yield make
    finally:
        for one in made:
            one.close()


def test_a_same_gpu_server_gets_a_handle_and_acts_as_with_host_buckets(servers, standin):
    """Server 0 declares the (stand-in) GPU, server 1 has CUDA IPC off: one publication,
    two formats, the same version and the same actions on both."""
    run = servers("auto", "off")
    publisher = WeightsPublisher(run.targets, timeout_s=20.0, context=run.ctx)
    try:
        weights = state(seed=5)
        results = publisher.publish(weights, version=1)
        assert publisher.formats == ["cuda_ipc", "state_dict"]
        assert [r["version"] for r in results] == [1, 1] and all(r["ok"] for r in results)
        np.testing.assert_array_equal(run.actions(0), run.actions(1))
        shared = standin.shared
        for version in (2, 3):  # later publications reuse the staging buffers, shared once
            results = publisher.publish(state(seed=version), version=version)
            assert all(r["ok"] for r in results) and publisher.formats[0] == "cuda_ipc"
        assert standin.shared == shared
        np.testing.assert_array_equal(run.actions(0), run.actions(1))
        # The server copied device to device: changing the publisher's tensors changes nothing there.
        before = run.actions(0)
        publisher.gpu.staging.buffers["trunk.0.weight"][0].zero_()  # type: ignore[union-attr]
        np.testing.assert_array_equal(run.actions(0), before)
        assert [r["version"] for r in publisher.rollback()] == [2, 2]
        assert run.servers[0].describe()["cuda_ipc"]["uuid"] == "GPU-standin-0000"
    finally:
        publisher.close()


def test_numpy_weights_or_a_publisher_told_not_to_go_as_host_buckets(servers, standin):
    run = servers("auto")
    for cuda, weights in ((True, {k: v.numpy() for k, v in state(1).items()}), (False, state(2))):
        publisher = WeightsPublisher(run.targets, timeout_s=20.0, context=run.ctx, cuda_ipc=cuda)
        try:
            version = 1 if cuda else 2
            assert publisher.publish(weights, version=version)[0]["version"] == version
            assert publisher.formats == ["state_dict"]
        finally:
            publisher.close()


def test_without_cuda_torch_tensors_go_as_host_buckets_and_it_says_why_once(servers, caplog):
    """The real CUDA checks: this machine has none."""
    run = servers("auto")
    publisher = WeightsPublisher(run.targets, timeout_s=20.0, context=run.ctx)
    try:
        with caplog.at_level(logging.INFO, logger="gateway.cuda_ipc"):
            for version in (1, 2):
                assert publisher.publish(state(version), version=version)[0]["ok"]
                assert publisher.formats == ["state_dict"]
        assert sum("no CUDA IPC from here" in r.message for r in caplog.records) == 1
    finally:
        publisher.close()


def test_bad_device_weights_are_refused_and_the_old_version_keeps_serving(servers, standin):
    run = servers("auto")
    publisher = WeightsPublisher(run.targets, timeout_s=20.0, context=run.ctx)
    try:
        before = run.actions(0)
        bad = state(3)
        bad["trunk.0.weight"][0, 0] = float("nan")
        with pytest.raises(RemoteError, match="has NaN or Inf"):
            publisher.publish(bad, version=1)
        short = state(3)
        short["trunk.0.bias"] = short["trunk.0.bias"][:5].clone()
        with pytest.raises(RemoteError, match="the network needs float32"):
            publisher.publish(short, version=2)
        np.testing.assert_array_equal(run.actions(0), before)
        assert publisher.publish(state(3), version=3)[0]["version"] == 3  # and it takes good ones
    finally:
        publisher.close()


def device_message(weights: dict[str, torch.Tensor], number: int, **meta: Any) -> Message:
    from gateway.cuda_ipc import Staging

    handle = Staging("cpu").handle(weights)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    base = {"version": number, "format": "cuda_ipc", "transfer": "t", "bucket": 0, "buckets": 1}
    base.update(tensors=len(weights), bytes=nbytes, cuda_ipc=handle)
    return Message(MsgType.WEIGHTS, seq=1, meta={**base, **meta})


@pytest.mark.unit
@pytest.mark.parametrize(
    ("change", "code", "match"),
    [
        ({"buckets": 2}, "bad_weights", "one WEIGHTS message of handles"),
        ({"version": 0}, "stale_version", "not newer than version 0"),
        ({"tensors": 99}, "bad_weights", "the meta announces 99"),
        ({"cuda_ipc": {"v": 1, "arrays": []}}, "bad_weights", "CUDA IPC handle"),
        ({"format": "pickle"}, "bad_weights", "unknown weights format 'pickle'"),
    ],
)
def test_the_assembler_checks_a_device_publication_without_opening_it(standin, change, code, match):
    assembler = WeightsAssembler()
    with pytest.raises(WeightsError, match=match) as caught:
        assembler.add(b"peer", device_message(state(1), 1, **change), current_version=0)
    assert caught.value.code.value == code
    update = assembler.add(b"peer", device_message(state(1), 2), current_version=0)
    assert update is not None and update.format == "cuda_ipc" and update.arrays == {}
    assert update.device is not None and len(update.device.arrays) == len(state(1))
    framed = device_message(state(1), 3)
    framed.arrays["x"] = np.zeros(3, np.float32)
    with pytest.raises(WeightsError, match="without arrays"):
        assembler.add(b"other", framed, current_version=0)


def test_a_server_with_cuda_ipc_off_refuses_device_weights_saying_what_to_send(servers, standin):
    run = servers("off")
    sock = run.ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(run.servers[0].addresses["weights"])
    send(sock, device_message(state(1), 1))
    assert sock.poll(10_000)
    answer = recv(sock)
    sock.close()
    assert answer.type is MsgType.ERROR and answer.meta["code"] == ErrorCode.BAD_WEIGHTS.value
    assert "publish host arrays" in answer.meta["message"]


@pytest.mark.unit
def test_state_dicts_of_tensors_are_checked_like_numpy_ones():
    expected = {"w": ("float32", (2, 3)), "n": ("int64", ())}
    good = {"w": torch.zeros(2, 3), "n": torch.tensor(4)}
    check_state_dict(good, expected)
    with pytest.raises(WeightsError, match=r"'w' is float64\[2, 3\], the network needs float32\[2, 3\]"):
        check_state_dict({**good, "w": torch.zeros(2, 3, dtype=torch.float64)}, expected)
    with pytest.raises(WeightsError, match="'w' has NaN or Inf"):
        check_state_dict({**good, "w": torch.full((2, 3), float("inf"))}, expected)


@pytest.mark.unit
def test_a_trainer_snapshot_on_the_device_reuses_its_buffers_and_finds_non_finite_values():
    """A CPU module stands in for the trainer's GPU one: the snapshot path is the same."""
    module = nn.Linear(3, 2)
    first = full_state_dict(module, device=True)
    assert all(isinstance(v, torch.Tensor) for v in first.values())
    again = full_state_dict(module, first, device=True)
    assert all(again[k] is first[k] for k in first)  # into the spare snapshot, no allocation
    assert again["weight"].data_ptr() != module.weight.data_ptr()  # a copy, never the live weights
    again["bias"][0] = float("nan")
    assert non_finite(again) == ["bias"] and non_finite(full_state_dict(module)) == []
