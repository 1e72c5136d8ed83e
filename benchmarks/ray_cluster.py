"""A three-node Ray cluster on this machine, for the Ray engine's tests and benchmarks
(``tests/test_ray*.py``, ``benchmarks/ray_engine.py``).

No GPU and no robot exist here, so custom resources stand for them (Ray schedules on
custom resources exactly as on ``GPU``; a robot's host in a lab is also best named by one):

- the head node is the **CPU node** (``cpu_node``): the gateway, the replay service and
  env workers may run there;
- node 2 is the **GPU node** (``gpu_node`` stands for its GPUs; ``cpu_node`` too): the
  inference replica and the trainer's ranks need ``gpu_node``; workers may run there;
- node 3 is the **robot host** of robot ``arm0`` (``robot_arm0``, label
  ``loopgate/host=arm0``): only the worker of that robot asks for it.

Each node declares its logical CPUs explicitly (the machine has two cores, shared: Ray's
CPU counts are reservations, oversubscribed on purpose); the dashboard is off and each
object store is 80 MiB (loopgate moves no data through Ray).
"""

from __future__ import annotations

import os
from typing import Any

OBJECT_STORE = 80 << 20
SYSTEM_CONFIG = {"health_check_period_ms": 500, "health_check_failure_threshold": 4, "worker_niceness": 0}
"""A removed node is declared dead in about 2 s instead of Ray's 30 s; actors run at
niceness 0 (Ray's default is 15), as the local engine's processes do."""

CPU_NODE = {"num_cpus": 6, "resources": {"cpu_node": 1}}
GPU_NODE = {"num_cpus": 6, "resources": {"gpu_node": 3, "cpu_node": 1}}
ROBOT_HOST = {"num_cpus": 2, "resources": {"robot_arm0": 1}, "labels": {"loopgate/host": "arm0"}}

PLACEMENT = {
    "inference": {"resources": {"gpu_node": 1}},
    "trainer": {"resources": {"gpu_node": 1}},
    "worker": {"resources": {"cpu_node": 1}},
}
"""``run.placement`` for the cluster: inference and trainer ranks on a GPU node, workers on CPU nodes."""


class ThreeNodes:
    """The cluster and its three nodes (``head``, ``gpu``, ``robot``)."""

    def __init__(self) -> None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                **CPU_NODE,
                "object_store_memory": OBJECT_STORE,
                "include_dashboard": False,
                "_system_config": SYSTEM_CONFIG,
            },
        )
        self.head = self.cluster.head_node
        self.gpu = self.add(GPU_NODE)
        self.robot = self.add(ROBOT_HOST)

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def add(self, spec: dict[str, Any]) -> Any:
        return self.cluster.add_node(**spec, object_store_memory=OBJECT_STORE)

    def remove(self, node: Any) -> None:
        self.cluster.remove_node(node, allow_graceful=False)

    def shutdown(self) -> None:
        self.cluster.shutdown()
