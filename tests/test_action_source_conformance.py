"""Every action source proves the action source contract.

In-process: the scripted policies ``random``, ``zero`` and ``reach_pd`` behind
``InProcessSource``. Remote: ``InferenceSource`` against a real ``python -m inference``
process (onnxruntime on the CPU), once in the server's stochastic mode and once asking
for deterministic actions, and with weights published to it over its weights socket.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
import yaml

from gateway.factory import experiment_spec
from gateway.policies import ActionSource, InProcessSource, make_policy
from inference.client import InferenceSource
from inference.weights import WeightsPublisher
from networks.modules import NetworkConfig, make_actor, state_dict_numpy
from tests.conformance.action_source import ActionSourceConformance
from tests.conftest import Procs, log_of, wait_for

SPEC = experiment_spec("mujoco_reach", {})
HIDDEN = (32, 32)


class InProcessConformance(ActionSourceConformance):
    spec = SPEC
    kind: ClassVar[str]

    @pytest.fixture
    def source(self) -> Iterator[ActionSource]:
        src = InProcessSource(make_policy(self.kind, SPEC, seed=0))
        yield src
        src.close()


class TestRandomPolicySourceConformance(InProcessConformance):
    kind = "random"
    stochastic = True
    honours_deterministic_rows = False  # random by design, in evaluation too (InProcessSource)


class TestZeroPolicySourceConformance(InProcessConformance):
    kind = "zero"


class TestReachPDPolicySourceConformance(InProcessConformance):
    kind = "reach_pd"


class InferenceServer:
    """One ``python -m inference`` process (onnxruntime, stochastic mode) on a run folder."""

    def __init__(self, procs: Procs, run_dir: Path) -> None:
        run_dir.mkdir(parents=True)
        config = {
            "env": {"backend": "mujoco_reach"},
            "inference": {
                "backend": "onnxruntime",
                "network": {"hidden_sizes": list(HIDDEN)},
                "deterministic": False,
                "max_wait_us": 200,
            },
        }
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
        (run_dir / "spec.json").write_text(json.dumps(SPEC.to_dict()))
        self.proc = procs.spawn(
            "-m", "inference", "--config", str(run_dir / "config.yaml"), "--run-dir", str(run_dir),
            name="inference",
        )  # fmt: skip
        endpoints = run_dir / "endpoints.json"

        def up() -> bool:
            assert self.proc.poll() is None, log_of(self.proc)
            return endpoints.exists() and bool(json.loads(endpoints.read_text()).get("inference"))

        wait_for(up, 60, what="inference server up")
        self.addresses: dict[str, str] = json.loads(endpoints.read_text())["inference"][0]


@pytest.fixture(scope="module")
def inference_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferenceServer]:
    tmp = tmp_path_factory.mktemp("inference-source")
    procs = Procs(tmp)
    try:
        yield InferenceServer(procs, tmp / "run")
    finally:
        procs.kill_all()


_versions = itertools.count(100)
"""Versions published to the shared server, always newer than the last."""


class InferenceSourceConformance(ActionSourceConformance):
    spec = SPEC
    ask_deterministic: ClassVar[bool | None] = None

    @pytest.fixture
    def source(self, inference_server: InferenceServer) -> Iterator[ActionSource]:
        src = InferenceSource(
            [inference_server.addresses], deadline_ms=5000.0, deterministic=self.ask_deterministic
        )
        self.server = inference_server
        try:
            yield src
        finally:
            src.close()

    def publish_new_version(self, source: ActionSource) -> int | None:
        version = next(_versions)
        actor = make_actor(SPEC, NetworkConfig(hidden_sizes=HIDDEN), seed=version)
        publisher = WeightsPublisher([self.server.addresses], timeout_s=20.0)
        try:
            [ack] = publisher.publish(state_dict_numpy(actor), version)
        finally:
            publisher.close()
        assert ack["ok"] and ack["version"] == version
        return version


class TestInferenceSourceConformance(InferenceSourceConformance):
    stochastic = True


class TestInferenceSourceDeterministicConformance(InferenceSourceConformance):
    ask_deterministic = True
