"""One trainer rank for ``benchmarks.trainer``: SAC updates fed by a real replay service.

    torchrun --standalone --nproc_per_node=2 -m benchmarks.trainer_worker ADDRESS UPDATES OUT.json

Builds the reach task's SAC (the default 256x256 networks), shards it with FSDP2 like the
trainer, samples its share of every 256-transition batch from the replay service at
``ADDRESS`` (4 requests in flight, as the trainer does), and times ``UPDATES`` updates
after a warm-up. Rank 0 writes updates/s, samples/s and the fraction of time spent
waiting for data.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

BATCH = 256


def main() -> None:
    address, updates, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    from trainer.distributed import init_distributed, shutdown

    torch.set_num_threads(1)
    world = init_distributed(timeout_s=120)
    figures = measure(world, address, updates)
    if world.is_main:
        out.write_text(json.dumps(figures))
    shutdown()  # once the sharded networks are gone, so the group does not outlive it


def measure(world: Any, address: str, updates: int) -> dict[str, float]:
    from gateway.factory import experiment_spec
    from networks.config import NetworkConfig
    from trainer.algos import make_algorithm
    from trainer.replay.client import ReplayClient

    spec = experiment_spec("mujoco_reach", {})
    algo = make_algorithm("sac", spec, NetworkConfig(), {}, device=world.device)
    algo.shard(world)
    algo.build_optimizers()
    client = ReplayClient(address, prefetch=4)
    per_rank = BATCH // world.size
    wait = compute = 0.0

    def step() -> None:
        nonlocal wait, compute
        t0 = time.perf_counter()
        arrays = client.sample(per_rank, tables="online", timeout_s=60)
        batch = {
            k: torch.from_numpy(np.ascontiguousarray(v))
            for k, v in arrays.items()
            if isinstance(v, np.ndarray) and v.dtype.kind in "biuf"
        }
        t1 = time.perf_counter()
        algo.update(batch)
        wait += t1 - t0
        compute += time.perf_counter() - t1

    for _ in range(10):
        step()
    wait = compute = 0.0
    start = time.perf_counter()
    for _ in range(updates):
        step()
    elapsed = time.perf_counter() - start
    client.close()
    return {
        "world": world.size,
        "updates_per_s": updates / elapsed,
        "samples_per_s": updates * BATCH / elapsed,
        "data_wait_frac": wait / (wait + compute),
    }


if __name__ == "__main__":
    main()
