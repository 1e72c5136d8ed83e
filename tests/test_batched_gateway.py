"""Batched workers through a real gateway process: bad batches get clear errors, their
episodes close as interrupted, and nothing acknowledged is lost.

Two layers hold the contract. A simulator that returns a tensor of the wrong leading
dimension, dtype or device is stopped by the Isaac Lab adapter inside its worker (the
worker says goodbye, the gateway closes its episodes); a batch that reaches the gateway
wrong anyway (a peer that skips those checks, framed or through shared memory) is
answered with an ERROR naming it and recorded nowhere. Real gateway process, real
ZeroMQ, real torch; the "meta" device stands in for a GPU the CPU machine lacks.
"""

from __future__ import annotations

import re
import threading
import uuid
from typing import Any

import numpy as np
import pytest
import torch
import zmq

from gateway import shm, steps
from gateway.factory import experiment_spec
from gateway.metrics import read_metrics
from gateway.protocol import Message, MsgType, recv, send
from gateway.store import EpisodeStore
from gateway.worker import EnvWorker
from sim_bridges.batched import TorchEnvBackend
from sim_bridges.torch_reach import OBS_DIM, TorchReachConfig, TorchReachEnv
from tests.conftest import time_left, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

N = 64
M = shm.MIN_BYTES // (8 * steps.WIDTH)
"""Envs of the hand-made worker: enough for its step_info to go through shared memory."""
CONFIG = {
    "env": {"backend": "torch_reach", "num_envs": N},
    "policy": {"kind": "random"},
    "gateway": {"worker_timeout_s": 3.0},
}


class FaultyReach(TorchReachEnv):
    """The torch reach, breaking the contract from step ``at`` on (``fault``)."""

    def __init__(self, fault: str, at: int) -> None:
        super().__init__(TorchReachConfig(), num_envs=N, seed=0)
        self.fault, self.at, self.steps = fault, at, 0

    def step(self, action: torch.Tensor) -> Any:
        obs, reward, terminated, time_outs, extras = super().step(action)
        self.steps += 1
        if self.steps >= self.at:
            policy = obs["policy"]
            obs = {
                "rows": {"policy": torch.cat([policy, policy[:1]])},
                "dtype": {"policy": policy.double()},
                "device": {"policy": torch.empty(policy.shape, device="meta")},
            }[self.fault]
        return obs, reward, terminated, time_outs, extras


FAULTS = {
    "rows": r"leading dimension \(65,\).*expected num_envs=64",
    "dtype": "is float64, expected float32",
    "device": "is on meta, expected the env's device cpu",
}


def test_a_simulator_tensor_breaking_the_contract_stops_its_worker_and_loses_nothing(gateway_run):
    run = gateway_run(CONFIG)
    acked = interrupted = 0
    for fault, message in FAULTS.items():  # one worker after the other, on one gateway
        backend = TorchEnvBackend(FaultyReach(fault, at=25), name="torch_reach", groups={"policy": "policy"})
        worker = EnvWorker(backend, run.endpoints["workers"], heartbeat_s=0.5, gateway_timeout_s=3.0)
        failure: list[BaseException] = []

        def serve(worker: EnvWorker = worker, failure: list[BaseException] = failure) -> None:
            try:
                worker.run()
            except BaseException as exc:  # the test inspects it
                failure.append(exc)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        thread.join(timeout=time_left())
        assert not thread.is_alive() and failure, f"{fault}: the worker did not stop at the bad tensor"
        assert isinstance(failure[0], ValueError) and re.search(message, str(failure[0])), failure[0]
        status = wait_for(
            lambda: (s := run.status())["workers"] == [] and s,
            timeout=time_left(),
            what="the worker to leave",
        )
        acked, interrupted = acked + N * 24, interrupted + N
        # The random policy answers in the gateway: each ACTION leaves before the steps it
        # completes are written, and the next answer acknowledges them (the worker stopped
        # first for the last 24th), while the gateway's count has all 24.
        assert worker.acked_steps == N * 23, fault
        assert status["episodes_interrupted"] == interrupted and status["open_episodes"] == 0, fault
        assert status["acked_steps"] == acked, fault
    assert run.drain()["drained"]
    count = EpisodeStore(run.run_dir / "episodes", readonly=True).count()
    assert count.stored_steps == acked and count.duplicate_steps == 0
    assert count.interrupted_episodes == interrupted


class RawWorker:
    """A worker speaking the protocol by hand, so that it can send what EnvWorker never would."""

    def __init__(self, address: str, num_envs: int, *, ring: bool) -> None:
        self.n, self.seq = num_envs, 0
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(address)
        self.ring = shm.ShmWriter.create(shm.slot_bytes_for(64 * num_envs * OBS_DIM)) if ring else None
        meta = {"uid": f"raw-{uuid.uuid4().hex[:6]}", "num_envs": num_envs}
        meta["spec"] = experiment_spec("torch_reach", {}).to_dict()
        if self.ring is not None:
            meta["shm"] = self.ring.offer()
        welcome = self.ask(Message(MsgType.HELLO, meta=meta))
        assert welcome.type is MsgType.WELCOME, welcome.meta
        assert welcome.meta.get("shm", {}).get("ok", False) is ring, welcome.meta
        self.episode = np.zeros(num_envs)

    def ask(self, msg: Message) -> Message:
        send(self.sock, self.ring.encode(msg) if self.ring is not None and msg.arrays else msg)
        assert self.sock.poll(int(time_left() * 1000)), f"no answer to {msg.type.name}"
        return recv(self.sock)

    def observe(self, rows: int | None = None, dtype: Any = np.float32) -> Message:
        rows = self.n if rows is None else rows
        self.seq += 1
        first = self.seq == 1
        info = steps.pack(
            episode=self.episode,
            step=float(self.seq - 1),
            t_capture=0.0,
            has_prev=0.0 if first else 1.0,
            reward=-1.0,
            terminated=0.0,
            truncated=0.0,
            success=0.0,
        )
        policy = np.full((rows, OBS_DIM), self.seq, dtype)
        return self.ask(
            Message(MsgType.OBSERVATION, seq=self.seq, arrays={"obs/policy": policy, "step_info": info})
        )

    def close(self) -> None:
        send(self.sock, Message(MsgType.BYE))
        self.sock.close()
        if self.ring is not None:
            self.ring.close()


BAD = {
    "leading dimension": ({"rows": 3}, rf"'policy' is float32\[3, 15\], expected float32\[{M}, 15\]"),
    "dtype": ({"dtype": np.float64}, rf"'policy' is float64\[{M}, 15\], expected float32\[{M}, 15\]"),
}


def test_a_wrong_batch_reaching_the_gateway_is_refused_by_name_and_the_worker_goes_on(gateway_run):
    run = gateway_run({**CONFIG, "env": {"backend": "torch_reach", "num_envs": M}})
    acked = 0
    for ring in (False, True):  # framed, then through shared memory
        peer = RawWorker(run.endpoints["workers"], M, ring=ring)
        try:
            assert peer.observe().type is MsgType.ACTION
            assert peer.observe().type is MsgType.ACTION  # completes M steps
            acked += M
            for what, (bad, message) in BAD.items():
                refused = peer.observe(**bad)
                assert refused.type is MsgType.ERROR and refused.meta["code"] == "bad_request", what
                assert refused.meta["message"].startswith("observation: "), what
                assert re.search(message, refused.meta["message"]), refused.meta["message"]
                assert run.status()["acked_steps"] == acked, what  # the bad batch recorded nothing
                peer.seq -= 1  # the same observation again, right this time
                reply = peer.observe()
                assert reply.type is MsgType.ACTION and reply.meta["acked"] == M, what
                acked += M
            (w,) = run.status()["workers"]
            assert w["shm"] is ring and (w["shm_bytes"] > 0) is ring
        finally:
            peer.close()
        status = wait_for(lambda: (s := run.status())["workers"] == [] and s, timeout=time_left(), what="BYE")
        assert status["acked_steps"] == acked and status["open_episodes"] == 0
    assert status["episodes_interrupted"] == 2 * M
    assert run.drain()["drained"]
    count = EpisodeStore(run.run_dir / "episodes", readonly=True).count()
    assert count.stored_steps == acked and count.duplicate_steps == 0


def test_a_simulators_episode_statistics_reach_the_gateways_status_and_metrics(gateway_run):
    """Isaac Lab's ``extras["log"]`` (here the torch reach's): forwarded by the worker on
    reset steps, kept by the gateway as ``env_log``, and written to ``metrics.jsonl``."""
    run = gateway_run({**CONFIG, "env": {**CONFIG["env"], "options": {"episode_length": 5}}})
    env = TorchReachEnv(TorchReachConfig(episode_length=5), num_envs=N, seed=0)
    backend = TorchEnvBackend(env, name="torch_reach", groups={"policy": "policy"})
    worker = EnvWorker(backend, run.endpoints["workers"], heartbeat_s=0.5, gateway_timeout_s=3.0)
    thread = threading.Thread(target=worker.run, kwargs={"max_steps": N * 40}, daemon=True)
    thread.start()
    status = wait_for(
        lambda: "Metrics/success_rate" in (s := run.status())["env_log"] and s,
        timeout=time_left(),
        what="the gateway's status to show the simulator's statistics",
    )
    thread.join(timeout=time_left())
    assert not thread.is_alive()
    log = status["env_log"]
    assert set(log) >= {"Episode_Reward/distance", "Metrics/success_rate", "Episode_Termination/time_out"}
    assert 0.0 <= log["Metrics/success_rate"] <= 1.0 and log["Episode_Reward/distance"] <= 0.0
    records = wait_for(
        lambda: [r for r in read_metrics(run.run_dir / "metrics.jsonl") if r.get("env_log")],
        timeout=time_left(),
        what="a metrics record with env_log",
    )
    assert "Metrics/success_rate" in records[-1]["env_log"]
